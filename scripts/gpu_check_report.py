"""Verdicts for scripts/gpu_check.sh: did the GPU tests really run and pass, did a sanitizer
report anything. Each verb prints one line (what the summary shows) and exits 0 (pass) or 1.

    python scripts/gpu_check_report.py tests RESULTS.xml [--allow-skip REGEX]
    python scripts/gpu_check_report.py sanitizer TOOL LOG EXIT_STATUS

``tests`` reads pytest's JUnit XML. It fails when the file is missing or unreadable (pytest
crashed or timed out), when any test failed or errored, when no test passed, and when any test
was skipped, unless every skip's reason matches ``--allow-skip``: on a GPU machine a skip means
something the check is there to exercise did not run (pytest itself exits 0 when all skip).

``sanitizer`` reads compute-sanitizer's output. It fails on any "ERROR SUMMARY: N errors" with
N > 0 (also "RACECHECK SUMMARY: N hazards"), when no summary was printed (the tool did not run
to the end), and when the program under it failed (pytest's own exit status, or the tool's
--error-exitcode).
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
import xml.etree.ElementTree as ET

#: the exit status gpu_check.sh passes to compute-sanitizer's --error-exitcode
SANITIZER_ERROR_EXIT = 86


def tests_verdict(xml_path: str, allow_skip: str | None) -> tuple[bool, str]:
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError) as e:
        return False, f"FAILED: no test results ({type(e).__name__}: {e}): pytest crashed or timed out"
    passed, failed, errors, skip_reasons = 0, [], [], collections.Counter()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            failed.append(name)
        elif case.find("error") is not None:
            errors.append(name)
        elif (skipped := case.find("skipped")) is not None:
            reason = (skipped.get("message") or "no reason").strip()
            if reason == "collection skipped" and skipped.text:   # a module skipped whole: the
                reason = skipped.text.strip().splitlines()[-1]    # text holds its reason
            skip_reasons[re.sub(r"^Skipped: ", "", reason)] += 1
        else:
            passed += 1
    n_skipped = sum(skip_reasons.values())
    counts = f"{passed} passed, {len(failed)} failed, {len(errors)} errors, {n_skipped} skipped"
    allowed = re.compile(allow_skip) if allow_skip else None
    refused = collections.Counter({r: n for r, n in skip_reasons.items()
                                   if not (allowed and allowed.search(r))})
    why = []
    if failed or errors:
        why.append("failing: " + ", ".join((failed + errors)[:5])
                   + (f" and {len(failed) + len(errors) - 5} more" if len(failed) + len(errors) > 5 else ""))
    if passed == 0:
        why.append("no GPU test ran")
    if refused:
        why.append("skipped: " + "; ".join(f"{n} x '{r}'" for r, n in refused.most_common(4)))
    if why:
        return False, f"FAILED ({counts}): " + " | ".join(why)
    return True, f"passed ({counts})"


def sanitizer_verdict(tool: str, log_path: str, status: int) -> tuple[bool, str]:
    try:
        text = open(log_path, errors="replace").read()
    except OSError as e:
        return False, f"{tool} FAILED: no log ({e})"
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    hazards = [int(n) for n in re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text)]
    tests = re.findall(r"^=* ?(\d+ (?:passed|failed|errors?|skipped|deselected)\b[^=\n]* in [\d.]+s[^=\n]*)",
                       text, re.M)
    ran = tests[-1].strip() if tests else "no pytest summary"
    if not errors and not hazards:
        return False, f"{tool} FAILED: no sanitizer summary (exit {status}; {ran})"
    total = sum(errors) + sum(hazards)
    if total:
        first = re.search(r"^=+ (?:Invalid|Uninitialized|Race|Barrier|Error|Warning)[^\n]*", text, re.M)
        detail = f": {first.group(0).lstrip('= ').strip()}" if first else ""
        return False, f"{tool} FAILED: {total} reports{detail} ({ran})"
    if status != 0:
        why = "the sanitizer's error exit" if status == SANITIZER_ERROR_EXIT else f"exit {status}"
        return False, f"{tool} FAILED: 0 reports but {why} ({ran})"
    return True, f"{tool} 0 errors ({ran})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    tests = verbs.add_parser("tests")
    tests.add_argument("xml")
    tests.add_argument("--allow-skip", default=None, help="regex of skip reasons that may pass")
    san = verbs.add_parser("sanitizer")
    san.add_argument("tool")
    san.add_argument("log")
    san.add_argument("status", type=int)
    args = parser.parse_args(argv)
    if args.verb == "tests":
        ok, line = tests_verdict(args.xml, args.allow_skip)
    else:
        ok, line = sanitizer_verdict(args.tool, args.log, args.status)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
