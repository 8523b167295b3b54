"""benchmarks/ab_variants.py: each variant runs from its own edited copy, interleaved with the
tree over rounds; an edit whose text is not where it expects is refused before anything runs."""
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN = "k31c/lowering/triton/topk_plan.py"
# what the command sees from its working directory: the constant as written there
PROBE = [sys.executable, "-c", f"import re; print(re.search(r'FILTER_PER_SM = (\\d+)', open('{PLAN}').read())[1])"]
BASE = re.search(r"FILTER_PER_SM = (\d+)", (ROOT / PLAN).read_text())[1]      # the tree's value


def ab(tmp_path, spec, *args):
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(spec))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks/ab_variants.py"), str(f), *args, "--", *PROBE],
                          capture_output=True, text=True, timeout=120)


def test_variants_run_from_their_edited_copies_interleaved(tmp_path):
    other = str(int(BASE) + 1)
    edit = {"file": PLAN, "old": f"FILTER_PER_SM = {BASE}", "new": f"FILTER_PER_SM = {other}"}
    out = ab(tmp_path, {"other": [edit]}, "--rounds", "2", "--out", str(tmp_path / "ab.txt"))
    assert out.returncode == 0, out.stderr
    want = "".join(f"== round {r}: base\n{BASE}\n== round {r}: other\n{other}\n" for r in (1, 2))
    assert out.stdout == want and (tmp_path / "ab.txt").read_text() == want
    assert f"FILTER_PER_SM = {BASE}" in (ROOT / PLAN).read_text()        # the tree untouched


def test_an_edit_that_does_not_match_is_refused(tmp_path):
    edit = {"file": PLAN, "old": f"FILTER_PER_SM = {BASE}", "new": "x", "count": 2}
    out = ab(tmp_path, {"twice": [edit]})
    assert out.returncode != 0 and f"holds 'FILTER_PER_SM = {BASE}' 1 times, the edit expects 2" in out.stderr
    assert "== round" not in out.stdout
    out = ab(tmp_path, {"outside": [{"file": "../etc/passwd", "old": "a", "new": "b"}]})
    assert out.returncode != 0 and "is not under k31c or benchmarks/" in out.stderr
