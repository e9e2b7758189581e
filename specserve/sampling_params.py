"""Per-request sampling settings (pure data, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Normalise list inputs so params stay hashable and picklable as one value.
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        errors = self.validation_errors()
        if errors:
            raise ValueError("; ".join(errors))

    def validation_errors(self) -> list[str]:
        errors = []
        if self.max_tokens is not None and self.max_tokens < 1:
            errors.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            errors.append(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            errors.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            errors.append(f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        return errors

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_tuple(stop: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(s for s in stop if s)
