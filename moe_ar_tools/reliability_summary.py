"""Markdown summary of a reliability run (issue #5): soak results and the reliability tests' records.

    python -m moe_ar_tools.reliability_summary --tests gpu-tests.jsonl \
        --soak soak-ws2.json soak-ws4.json soak-ws8.json --out bench_results/reliability/summary.md

--tests: the JSON lines the GPU tests append through `record_result` (MOE_AR_RESULTS); the lines of
tests/test_gpu_reliability.py (kind "reliability") are summarized one by one, every other test is
counted. --soak: the JSON files of `moe-ar-soak`. Writes calls made, faults injected,
outcomes, machine and commit; prints one line with the overall result. --junit: pytest's JUnit XML files
(GPU and CPU runs): the table of hostile cases (HOSTILE_CASES) gets each case's tests and their
outcome. --strict: exit 1 when anything failed (default: exit 0 once the summary is written; 2 for
unreadable inputs).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys


def load_jsonl(path) -> list:
    rows = []
    for i, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e})") from None
    return rows


# Hostile cases (issue 24: never silently wrong): the input, what happens, and the tests that show it
# (file::test prefixes; every test of a prefix counts).
HOSTILE_CASES = (
    ("W 2, H 16384, max_tokens 131072: a 131,072-token two-shot call (2^32 elements in its buffer), "
     "then small calls with a rank 50 ms late", "the buffer is cleared in full; every element correct",
     ("test_gpu_faults::test_buffer_extent_past_2_32_elements_is_cleared",)),
    ("max_tokens, hidden or oneshot_max_tokens past what a device count holds", "ValueError naming it",
     ("test_sizes_cpu::",)),
    ("norm_out=allreduce_in[:T]; norm_out is residual_out; any output over an input or another output",
     "ValueError naming the output", ("test_integrity_cpu::test_an_output_overlapping_an_input_is_named",
                                      "test_integrity_cpu::test_two_overlapping_outputs_are_named",
                                      "test_integrity_cpu::test_natural_memory_reuse_is_refused",
                                      "test_call_plan_cpu::test_overlap_after_a_plan")),
    ("residual_out is residual_in (in place)", "accepted; every family and profile correct",
     ("test_gpu_hostile::test_residual_out_may_be_residual_in",)),
    ("EmulatedWorld: one rank's output over another rank's tensor", "ValueError naming per_rank_kwargs[r]",
     ("test_gpu_hostile::test_an_output_over_another_ranks_tensor_is_refused",)),
    ("ranks that disagree (dtype, hidden, max_tokens, one-shot capacity, split, deadline, buffer size, "
     "programs, backend, host, GPU)", "the same ValueError naming the field on every rank, before allocating",
     ("test_rendezvous_cpu::", "test_symm_mem_cpu::test_a_backend_mismatch")),
    ("two processes on one GPU", "ValueError naming device on both",
     ("test_gpu_reliability::test_two_processes_on_one_gpu_are_refused",)),
    ("a late rank inside a captured CUDA graph, then five more replays and a PDL-queued call",
     "every later output NaN (quant bytes 0x7F), no exchange; the host raises; reset() recovers",
     ("test_gpu_faults::test_after_a_timeout_graph_replays_write_the_poisoned_output",)),
    ("eps 0 / NaN / inf, routed_scaling_factor NaN, bools for ints, timeout_s NaN / inf / over a day, "
     "oneshot_max_tokens outside 1..max_tokens", "ValueError naming it",
     ("test_integrity_cpu::test_a_bad_scalar_is_named", "test_rendezvous_cpu::test_timeout_limits",
      "test_rendezvous_cpu::test_a_bad_constructor_argument_on_any_rank_is_named_on_every_rank")),
    ("global_scale, fp8_scale, quant_out or scale_out with a quant that does not use it",
     "ValueError naming it", ("test_integrity_cpu::test_an_argument_the_quant_does_not_use_is_named",)),
    ("device global_scale / fp8_scale 0, -0, negative, NaN, +-inf, subnormal, huge",
     "the documented bytes (dispatch/API.md), equal to the reference",
     ("test_gpu_hostile::test_special_device_scale_bytes_follow_the_rule",)),
    ("a planted cubin in a foreign or group/world-writable cache directory; a symlinked entry; 4 threads "
     "and 4 processes filling one entry", "never loaded / never followed / the right cubin", ("test_cache_cpu::",)),
    ("a constructor failing on one rank (out of memory, IPC)", "everything freed; every rank raises",
     ("test_gpu_reliability::test_emulated_world_allocation_failure_frees_every_rank",
      "test_rendezvous_cpu::test_a_constructor_step_failing_on_one_rank_frees_everything_on_every_rank")),
    ("a workspace dropped without close()", "leaves the live set; dispatch.check() unaffected",
     ("test_rendezvous_cpu::test_live_workspaces_are_held_weakly_and_checked",)),
)


def load_junit(path) -> dict:
    """{"file::test[id]": "passed" | "failed" | "skipped"} from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
            elif child.tag == "skipped" and status == "passed":
                status = "skipped"
        out[f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"] = status
    return out


def hostile_table(junit: dict) -> tuple[list, bool]:
    """Markdown rows of HOSTILE_CASES with their tests' outcomes, and whether all that ran passed."""
    rows, ok = [], True
    for given, outcome, prefixes in HOSTILE_CASES:
        ran = {k: v for k, v in junit.items() if any(k.startswith(p) for p in prefixes)}
        passed = sum(v == "passed" for v in ran.values())
        failed = sum(v == "failed" for v in ran.values())
        ok &= failed == 0
        result = "FAIL" if failed else ("PASS" if passed else "not run")
        rows.append([given, outcome, ", ".join(p.rstrip(":") for p in prefixes), f"{passed} passed, {failed} failed",
                     result])
    return rows, ok


def load_soak(path) -> dict:
    d = json.loads(pathlib.Path(path).read_text())
    if not isinstance(d, dict) or "calls" not in d or "world_size" not in d:
        raise ValueError(f"{path}: not a soak result")
    d["_file"] = str(path)
    return d


def is_reliability(row: dict) -> bool:
    return row.get("kind") == "reliability" or "test_gpu_reliability" in str(row.get("test", ""))


def _short_test(t: str) -> str:
    return str(t).split("::", 1)[-1] if t else "?"


def _fmt_int(n) -> str:
    return f"{n:,}" if isinstance(n, int) else ("-" if n is None else str(n))


def _cell(v) -> str:
    s = "-" if v is None else str(v)
    return s.replace("|", "\\|").replace("\n", " ")


def _table(header, rows) -> list:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return out


def _machine(soaks, tests, override=None) -> str:
    if override:
        return override
    # the record that saw the most GPUs (a soak pinned with CUDA_VISIBLE_DEVICES sees one)
    seen = [(int((s.get("machine") or {}).get("gpus") or 0), (s.get("machine") or {}).get("gpu"),
             (s.get("machine") or {}).get("hostname")) for s in soaks]
    seen += [(int(t.get("gpus") or 0), t.get("gpu"), None) for t in tests]
    seen = [x for x in seen if x[1]]
    if not seen:
        return "unknown"
    gpus = max(x[0] for x in seen)
    gpu = next(x[1] for x in seen if x[0] == gpus)
    host = next((x[2] for x in seen if x[2]), None)
    return f"{gpus}x {gpu}" + (f" ({host})" if host else "")


def _commit(soaks, override=None) -> str:
    if override:
        return override
    commits = sorted({s.get("commit") for s in soaks if s.get("commit") and s.get("commit") != "unknown"})
    if commits:
        return ", ".join(commits)
    return os.environ.get("MOE_AR_COMMIT", "unknown")


def _soak_passed(s: dict) -> bool:
    if "passed" in s:
        return bool(s["passed"])
    return (s.get("calls", 0) > 0 and not s.get("wrong_elements") and not s.get("timeouts")
            and not s.get("hangs") and not s.get("full_check_failures"))


def summarize(tests: list, soaks: list, *, machine=None, commit=None, date=None, junit=None) -> tuple[str, bool]:
    """(markdown, all passed)."""
    rel = [t for t in tests if is_reliability(t)]
    others = [t for t in tests if not is_reliability(t)]
    soak_calls = sum(int(s.get("calls", 0)) for s in soaks)
    # a multi-process test writes one row per rank for the same collective calls: count rank 0's
    counted = [t for t in rel if int(t.get("rank", 0) or 0) == 0]
    test_calls = sum(int(t.get("calls", 0) or 0) for t in counted)
    faults = sum(int(t.get("faults_injected", 0) or 0) for t in counted)
    hostile = sum(int(t.get("hostile_calls", 0) or 0) for t in rel)
    wrong = sum(int(s.get("wrong_elements", 0)) for s in soaks)
    timeouts = sum(int(s.get("timeouts", 0)) for s in soaks)
    hangs = sum(int(s.get("hangs", 0)) for s in soaks)
    full = sum(int(s.get("full_checks", 0)) for s in soaks)
    full_bad = sum(int(s.get("full_check_failures", 0)) for s in soaks)
    rel_failed = [t for t in rel if not t.get("passed", False)]
    other_failed = [t for t in others if t.get("passed") is False]
    soak_failed = [s for s in soaks if not _soak_passed(s)]
    ok = bool(soaks or rel) and not rel_failed and not soak_failed and not other_failed
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")

    lines = [f"# Reliability: faults, soak, hostile input, lifetimes ({'PASS' if ok else 'FAIL'})", "",
             f"Machine: {_machine(soaks, tests, machine)}; commit: {_commit(soaks, commit)}; date: {date}.", ""]
    lines += _table(["", "count"], [
        ["calls made (soak + reliability tests)", _fmt_int(soak_calls + test_calls)],
        ["  soak calls", _fmt_int(soak_calls)],
        ["  reliability test calls (valid calls, each checked in full)", _fmt_int(test_calls)],
        ["faults injected (late ranks, ranks stopped mid-exchange)", _fmt_int(faults)],
        ["hostile calls (each a ValueError naming the argument)", _fmt_int(hostile)],
        ["wrong elements (soak)", _fmt_int(wrong)],
        ["soak full reference checks (failed)", f"{_fmt_int(full)} ({_fmt_int(full_bad)})"],
        ["soak timeouts (no fault injected: must be 0)", _fmt_int(timeouts)],
        ["hangs", _fmt_int(hangs)],
        ["reliability tests passed / run", f"{len(rel) - len(rel_failed)} / {len(rel)}"],
    ])
    lines.append("")

    if junit:
        rows, hostile_ok = hostile_table(junit)
        ok = ok and hostile_ok
        lines[0] = f"# Reliability: faults, soak, hostile input, lifetimes ({'PASS' if ok else 'FAIL'})"
        lines += ["## Hostile cases (never silently wrong)", ""]
        lines += _table(["input", "what happens", "tests", "outcome", "result"], rows)
        lines.append("")

    lines += ["## Soak", ""]
    if soaks:
        rows = []
        for soak in sorted(soaks, key=lambda s: (s.get("world_size", 0), str(s.get("devices")))):
            regimes = ", ".join(f"{k} {_fmt_int(v)}" for k, v in sorted((soak.get("regimes") or {}).items()))
            quant_calls = soak.get("quant_calls") or {}
            devs = soak.get("devices") or []
            devices = "one GPU" if soak.get("single_device") else ",".join(map(str, devs))
            rows.append([soak.get("world_size"), devices,
                         soak.get("dtype"), _fmt_int(soak.get("calls")), _fmt_int(soak.get("eager_calls")),
                         _fmt_int(soak.get("graph_calls")), _fmt_int(soak.get("pdl_calls")), _fmt_int(quant_calls.get("nvfp4", 0)),
                         regimes, _fmt_int(soak.get("wrong_elements")), _fmt_int(soak.get("full_checks")),
                         _fmt_int(soak.get("timeouts")), _fmt_int(soak.get("hangs")), soak.get("seconds"),
                         "PASS" if _soak_passed(soak) else "FAIL"])
        lines += _table(["W", "devices", "dtype", "calls", "eager", "graph", "PDL", "NVFP4", "regimes (calls)",
                         "wrong elements", "full checks", "timeouts", "hangs", "seconds", "result"], rows)
        lines.append("")
        for soak in soaks:
            notes = [f"`{pathlib.Path(soak['_file']).name}`" if soak.get("_file") else "soak",
                     f"max_tokens {soak.get('max_tokens')}, hidden {soak.get('hidden')}, seed {soak.get('seed')}",
                     f"T {soak.get('tokens', {}).get('min')}..{soak.get('tokens', {}).get('max')} "
                     f"({soak.get('tokens', {}).get('distinct')} distinct)",
                     f"boundaries {soak.get('boundaries')}", f"stopped by {soak.get('stopped_by')}"]
            if soak.get("graph_note"):
                notes.append(soak["graph_note"])
            if not soak.get("reference_importable", True):
                notes.append("the reference was not importable: no full checks")
            if soak.get("error"):
                notes.append(f"error: {str(soak['error']).splitlines()[0]}")
            for failure in (soak.get("failures") or [])[:3]:
                notes.append(f"failure: {json.dumps(failure, default=str)[:300]}")
            lines.append("- " + "; ".join(notes) + ".")
        lines.append("")
    else:
        lines += ["(no soak results given)", ""]

    def section(title, pred, extra_cols):
        sel = [t for t in rel if pred(t)]
        if not sel:
            return
        lines.extend([f"## {title}", ""])
        rows = []
        for t in sel:
            rows.append([_short_test(t.get("test")), t.get("world_size"), t.get("devices")]
                        + [t.get(c) for c in extra_cols]
                        + [(t.get("outcome") if t.get("passed") else t.get("error")) or t.get("outcome")
                           or t.get("error") or (t.get("failures") or [None])[0], t.get("seconds"),
                           "PASS" if t.get("passed") else "FAIL"])
        lines.extend(_table(["test", "W", "devices"] + extra_cols + ["outcome", "seconds", "result"], rows))
        lines.append("")

    what = lambda t: str(t.get("what", ""))  # noqa: E731
    section("Faults: a late rank", lambda t: what(t).startswith("late rank"),
            ["regime", "timeout_s", "delay_ms", "faults_injected", "calls"])
    section("Faults: a rank stops mid-exchange", lambda t: what(t).startswith("rank stops"),
            ["regime", "timeout_s", "stop_after_units", "wall_s", "faults_injected", "calls"])
    section("Hostile input", lambda t: "hostile" in what(t) or "closed" in what(t), ["hostile_calls", "calls"])
    section("Lifetimes", lambda t: any(k in what(t) for k in ("world", "cycles", "group")),
            ["calls", "cycles_done", "device_memory_drift_bytes"])
    known = ("late rank", "rank stops", "hostile", "closed", "world", "cycles", "group")
    section("Other reliability tests", lambda t: not any(k in what(t) for k in known), ["calls", "faults_injected"])

    if others:
        lines += ["## Other GPU tests in the same run", "",
                  f"{len(others)} records, {len(other_failed)} failed"
                  + (": " + ", ".join(_short_test(t.get("test")) for t in other_failed[:10]) if other_failed else "")
                  + ".", ""]
    return "\n".join(lines).rstrip() + "\n", ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ar_tools.reliability_summary",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", default=None, help="JSON lines of the GPU tests (MOE_AR_RESULTS)")
    parser.add_argument("--soak", nargs="*", default=[], help="soak JSON files (moe-ar-soak --out)")
    parser.add_argument("--out", default=None, help="markdown path (default: print)")
    parser.add_argument("--machine", default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--date", default=None)
    parser.add_argument("--junit", nargs="*", default=[], help="pytest JUnit XML files (GPU and CPU runs)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when anything failed")
    args = parser.parse_args(argv)
    try:
        tests = load_jsonl(args.tests) if args.tests else []
        soaks = [load_soak(s) for s in args.soak]
        junit = {}
        for path in args.junit:
            junit.update(load_junit(path))
    except (OSError, ValueError) as e:
        print(f"reliability_summary: {e}", file=sys.stderr)
        return 2
    if not tests and not soaks:
        print("reliability_summary: nothing to summarize (give --tests and/or --soak)", file=sys.stderr)
        return 2
    text, ok = summarize(tests, soaks, machine=args.machine, commit=args.commit, date=args.date, junit=junit)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}: {'PASS' if ok else 'FAIL'}")
    else:
        print(text)
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
