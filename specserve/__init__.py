"""specserve: an LLM serving engine built around speculative decoding that is never a loss."""
from specserve.core import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; keep `import specserve` light for the pure-Python parts.
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
