"""``kvserve simulate``: the output format, workload rules, and clear errors (never a hang)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.entrypoints.cli import main as kvserve_main
from kvserve.sched.mixed import MixedScheduler
from kvserve.sim.cli import main as simulate_main
from kvserve.sim.workload import parse_workload, prefix_tokens, unique_tokens


def write(tmp_path, workload):
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(workload) if not isinstance(workload, str) else workload)
    return str(path)


def run(tmp_path, capsys, workload, *flags):
    """(exit code, parsed stdout or None, stderr)."""
    rc = simulate_main([write(tmp_path, workload), *flags])
    captured = capsys.readouterr()
    return rc, (json.loads(captured.out) if rc == 0 else None), captured.err


ISSUE_EXAMPLE = {
    "requests": [
        {"id": f"d{i}", "arrival_step": 0, "prompt_len": 16, "max_tokens": 30} for i in range(4)
    ]
    + [
        {
            "id": "A",
            "arrival_step": 1,
            "prompt_len": 2048,
            "max_tokens": 16,
            "shared_prefix": {"id": "sys", "len": 1024},
            "mutate": [[5, 999]],
            "cache_salt": "t1",
        }
    ]
}


def test_output_format(tmp_path, capsys):
    rc, result, err = run(tmp_path, capsys, ISSUE_EXAMPLE, "--max-num-batched-tokens", "512")
    assert rc == 0 and err == ""
    assert list(result) == ["config", "steps", "requests", "summary"]
    assert result["config"]["max_num_batched_tokens"] == 512
    assert result["config"]["scheduler_policy"] == "mixed"
    step = result["steps"][1]
    assert list(step) == [
        "step", "phase", "num_scheduled_tokens", "num_scheduled_tokens_padded",
        "num_computed_tokens", "decode_batch_padded", "num_running", "num_waiting", "kv_usage",
        "predicted_ms",
    ]  # fmt: skip
    assert step["step"] == 1 and step["phase"] == "mixed"
    assert step["num_scheduled_tokens"]["A"] == 508
    assert step["num_scheduled_tokens_padded"]["A"] == 508  # mixed policy: no padding
    assert step["num_computed_tokens"] == {"d0": 16, "d1": 16, "d2": 16, "d3": 16, "A": 0}
    assert step["decode_batch_padded"] is None
    assert (step["num_running"], step["num_waiting"]) == (5, 0)
    assert 0 < step["kv_usage"] < 1
    assert list(result["requests"]) == ["d0", "d1", "d2", "d3", "A"]
    assert result["requests"]["A"] == {
        "num_prompt_tokens": 2048,
        "num_cached_tokens": 0,
        "num_output_tokens": 16,
        "first_scheduled_step": 1,
        "first_token_step": 5,
        "finish_step": 20,
        "num_preemptions": 0,
    }
    assert result["summary"] == {
        "num_steps": len(result["steps"]),
        "total_padding_tokens": 0,
        "prefix_cache_hit_rate": 0.0,
        "num_preemptions": 0,
    }
    assert [s["step"] for s in result["steps"]] == list(range(len(result["steps"])))


def test_kvserve_simulate_subcommand_writes_output_file(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = kvserve_main(
        ["simulate", write(tmp_path, ISSUE_EXAMPLE), "--policy", "separated", "--output", str(out)]
    )
    assert rc == 0 and capsys.readouterr().out == ""
    result = json.loads(out.read_text())
    assert result["config"]["scheduler_policy"] == "separated"
    assert all(s["phase"] != "mixed" for s in result["steps"])


def test_arrivals_are_visible_from_their_step_and_idle_steps_are_recorded(tmp_path, capsys):
    workload = {"requests": [{"id": "late", "arrival_step": 3, "prompt_len": 4, "max_tokens": 2}]}
    rc, result, _ = run(tmp_path, capsys, workload)
    assert rc == 0
    assert [s["phase"] for s in result["steps"]] == ["idle"] * 3 + ["prefill", "decode"]
    assert result["requests"]["late"]["first_scheduled_step"] == 3


def test_prompts_are_deterministic_shared_prefixes_match_and_mutate_applies():
    reqs = parse_workload(
        {
            "requests": [
                {
                    "id": "a",
                    "prompt_len": 40,
                    "max_tokens": 1,
                    "shared_prefix": {"id": "p", "len": 32},
                },
                {
                    "id": "b",
                    "prompt_len": 40,
                    "max_tokens": 1,
                    "shared_prefix": {"id": "p", "len": 16},
                },
                {"id": "c", "prompt_token_ids": [5, 6, 7], "max_tokens": 1, "mutate": [[1, 0]]},
            ]
        }
    )
    a, b, c = (r.prompt_token_ids for r in reqs)
    assert a[:16] == b[:16] == tuple(prefix_tokens("p", 16))
    assert a[:32] == tuple(prefix_tokens("p", 32))
    assert a[32:] == tuple(unique_tokens("a", 8)) and b[16:] == tuple(unique_tokens("b", 24))
    assert a[32:] != b[32:]
    assert c == (5, 0, 7)
    assert parse_workload({"requests": [{"id": "a", "prompt_len": 40, "max_tokens": 1}]})[
        0
    ].prompt_token_ids == tuple(unique_tokens("a", 40))


def test_cache_salt_separates_prefix_hits(tmp_path, capsys):
    def workload(salt_b):
        prefix = {"id": "sys", "len": 64}
        return {
            "requests": [
                {"id": "a", "prompt_len": 80, "max_tokens": 1, "shared_prefix": prefix, "cache_salt": "t1"},
                {"id": "b", "arrival_step": 2, "prompt_len": 80, "max_tokens": 1,
                 "shared_prefix": prefix, "cache_salt": salt_b},
            ]
        }  # fmt: skip

    _, same, _ = run(tmp_path, capsys, workload("t1"))
    _, other, _ = run(tmp_path, capsys, workload("t2"))
    assert same["requests"]["b"]["num_cached_tokens"] == 64
    assert other["requests"]["b"]["num_cached_tokens"] == 0


def test_tight_kv_cache_preempts_and_still_finishes(tmp_path, capsys):
    workload = {"requests": [{"id": f"r{i}", "prompt_len": 8, "max_tokens": 12} for i in range(3)]}
    rc, result, _ = run(
        tmp_path,
        capsys,
        workload,
        "--block-size",
        "4",
        "--num-kv-blocks",
        "13",
        "--max-model-len",
        "64",
    )
    assert rc == 0
    assert result["summary"]["num_preemptions"] >= 1
    assert (
        sum(r["num_preemptions"] for r in result["requests"].values())
        == result["summary"]["num_preemptions"]
    )
    assert all(r["num_output_tokens"] == 12 for r in result["requests"].values())


@pytest.mark.parametrize(
    ("workload", "flags", "message"),
    [
        ("{not json", [], "not valid JSON"),
        ({"reqs": []}, [], 'must be an object with a "requests" list'),
        ({"requests": []}, [], "requests list is empty"),
        ({"requests": [{"id": "A", "prompt_len": 5}]}, [], "invalid max_tokens=None"),
        ({"requests": [{"id": "A", "max_tokens": 5}]}, [], "invalid prompt_len=None"),
        ({"requests": [{"id": "A", "prompt_len": 5, "max_tokens": 1, "max_token": 3}]}, [],
         "unknown key(s) max_token"),
        ({"requests": [{"id": "A", "prompt_len": 5, "max_tokens": 1}] * 2}, [], "appears twice"),
        ({"requests": [{"id": "A", "prompt_len": 5, "max_tokens": 1, "mutate": [[9, 1]]}]}, [],
         "invalid mutate"),
        ({"requests": [{"id": "A", "prompt_len": 5, "max_tokens": 1,
                        "shared_prefix": {"id": "s", "len": 9}}]}, [], "invalid shared_prefix"),
        ({"requests": [{"id": "A", "prompt_len": 8000, "max_tokens": 500}]}, [],
         "exceeds max_model_len=8192"),
        ({"requests": [{"id": "A", "prompt_len": 100, "max_tokens": 1}]}, ["--num-kv-blocks", "5"],
         "request 'A' may need KV for 100 tokens"),
        ({"requests": [{"id": "A", "prompt_len": 5, "max_tokens": 1}]},
         ["--num-batched-tokens-buckets", "512,1024"], "num_batched_tokens_buckets=[512, 1024]"),
        ({"requests": [{"id": "A", "prompt_len": 5, "max_tokens": 1}]},
         ["--num-seqs-buckets", "1,x"], "comma-separated integers"),
        ({"requests": [{"id": "A", "prompt_len": 5, "max_tokens": 1}]}, ["--kv-segment-size", "100"],
         "kv_segment_size=100"),
        ({"requests": [{"id": "A", "prompt_len": 5, "max_tokens": 1}]}, ["--num-kv-blocks", "1"],
         "num_kv_blocks=1"),
    ],
)  # fmt: skip
def test_bad_workload_or_config_exits_2_with_a_clear_message(
    tmp_path, capsys, workload, flags, message
):
    rc, result, err = run(tmp_path, capsys, workload, *flags)
    assert rc == 2 and result is None
    assert err.startswith("kvserve simulate: error: ")
    assert message in err


def test_missing_workload_file_exits_2(tmp_path, capsys):
    assert simulate_main([str(tmp_path / "nope.json")]) == 2
    assert "cannot read workload file" in capsys.readouterr().err


def test_step_limit_exits_1(tmp_path, capsys):
    workload = {"requests": [{"id": "A", "prompt_len": 5, "max_tokens": 50}]}
    rc, _, err = run(tmp_path, capsys, workload, "--max-steps", "10")
    assert rc == 1 and "did not finish within max_steps=10" in err


def test_no_progress_is_an_error_not_a_hang(tmp_path, capsys, monkeypatch):
    # A scheduler that never schedules anything: the simulator must notice at once.
    real_schedule = MixedScheduler.schedule

    def stuck(self):
        out = real_schedule(self)
        for r in list(self.running):
            self._preempt(r)
        out.num_scheduled_tokens.clear()
        return out

    monkeypatch.setattr(MixedScheduler, "schedule", stuck)
    workload = {"requests": [{"id": "A", "prompt_len": 5, "max_tokens": 5}]}
    rc, _, err = run(tmp_path, capsys, workload)
    assert rc == 1
    assert "step 0: nothing could be scheduled although 1 requests are unfinished" in err


def test_simulate_never_imports_torch():
    code = (
        "import sys; from kvserve.sim.cli import main; import kvserve.sched; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_any_token_id_is_accepted_unless_a_vocab_size_is_given(tmp_path, capsys):
    """Seed 002's walkthrough mutates a token to 999999: a simulator has no vocabulary."""
    workload = {
        "requests": [
            {"id": "a", "prompt_len": 40, "max_tokens": 2, "mutate": [[5, 999999]]},
            {"id": "b", "prompt_token_ids": [1, 70000, 3], "max_tokens": 1},
        ]
    }
    rc, out, err = run(tmp_path, capsys, workload)
    assert rc == 0, err
    assert len(out["requests"]) == 2
    rc, out, err = run(tmp_path, capsys, workload, "--vocab-size", "49152")
    assert rc == 2
    assert "999999" in err or "70000" in err
    assert "49152" in err


def test_step_time_budget_bounds_mixed_steps(tmp_path, capsys):
    """With --max-step-ms the reference cost model sizes prompt chunks beside decodes:
    every mixed step is predicted within the target (the minimum progress rule never
    needed here), and a prompt over a longer cached context gets fewer tokens."""
    workload = {
        "requests": [
            {"id": f"d{i}", "arrival_step": 0, "prompt_len": 16, "max_tokens": 60} for i in range(4)
        ]
        + [{"id": "L", "arrival_step": 1, "prompt_len": 3000, "max_tokens": 4}]
    }
    rc, result, err = run(
        tmp_path, capsys, workload, "--max-num-batched-tokens", "2048", "--max-step-ms", "100"
    )
    assert rc == 0 and err == ""
    assert result["config"]["max_step_ms"] == 100
    mixed = [s for s in result["steps"] if s["phase"] == "mixed"]
    assert len(mixed) >= 3
    assert all(0 < s["predicted_ms"] <= 100.0 for s in mixed)
    chunks = [s["num_scheduled_tokens"]["L"] for s in mixed if "L" in s["num_scheduled_tokens"]]
    assert chunks[0] > chunks[-2] > 32  # later chunks sit over more context
    rc, off, _ = run(tmp_path, capsys, workload, "--max-num-batched-tokens", "2048")
    assert rc == 0
    first = next(s for s in off["steps"] if "L" in s["num_scheduled_tokens"])
    assert first["num_scheduled_tokens"]["L"] == 2048 - 4  # token budget only
    assert first["predicted_ms"] > 100.0
