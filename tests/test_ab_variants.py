"""benchmarks/ab_variants.py: each variant runs from its own edited copy, interleaved with the
tree over rounds; an edit whose text is not where it expects is refused before anything runs."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN = "k31c/lowering/triton/topk_plan.py"
# what the command sees from its working directory: the constant as written there
PROBE = [sys.executable, "-c", f"import re; print(re.search(r'FILTER_PROGRAMS = (\\d+)', open('{PLAN}').read())[1])"]


def ab(tmp_path, spec, *args):
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(spec))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks/ab_variants.py"), str(f), *args, "--", *PROBE],
                          capture_output=True, text=True, timeout=120)


def test_variants_run_from_their_edited_copies_interleaved(tmp_path):
    edit = {"file": PLAN, "old": "FILTER_PROGRAMS = 8192", "new": "FILTER_PROGRAMS = 4096"}
    out = ab(tmp_path, {"fewer": [edit]}, "--rounds", "2", "--out", str(tmp_path / "ab.txt"))
    assert out.returncode == 0, out.stderr
    want = "== round 1: base\n8192\n== round 1: fewer\n4096\n== round 2: base\n8192\n== round 2: fewer\n4096\n"
    assert out.stdout == want and (tmp_path / "ab.txt").read_text() == want
    assert "FILTER_PROGRAMS = 8192" in (ROOT / PLAN).read_text()        # the tree untouched


def test_an_edit_that_does_not_match_is_refused(tmp_path):
    edit = {"file": PLAN, "old": "FILTER_PROGRAMS = 8192", "new": "x", "count": 2}
    out = ab(tmp_path, {"twice": [edit]})
    assert out.returncode != 0 and "holds 'FILTER_PROGRAMS = 8192' 1 times, the edit expects 2" in out.stderr
    assert "== round" not in out.stdout
    out = ab(tmp_path, {"outside": [{"file": "../etc/passwd", "old": "a", "new": "b"}]})
    assert out.returncode != 0 and "is not under k31c or benchmarks/" in out.stderr
