"""The `k31c` command line: init -> logits determinism, generate, and clear errors on bad input.

Subprocess runs (each imports torch, ~3 s) cover the real entry point; the bad-input cases call
`main()` in-process, where an escaping exception would be the traceback a user sees.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from k31c.checkpoint import load_checkpoint
from k31c.cli import main
from k31c.runtime.engine import Engine
from k31c.tokenizer import BOS_ID, EOS_ID, ByteTokenizer

REPO = Path(__file__).resolve().parents[1]


def _k31c(*args, home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, K31C_HOME=str(home), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "k31c", *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("k31c-home")


@pytest.fixture(scope="module")
def checkpoint(home):
    out = home / "seed3"
    r = _k31c("init", "--config", "tiny", "--seed", "3", "--out", str(out), home=home)
    assert r.returncode == 0, r.stderr
    return out


def test_logits_deterministic_and_equal_to_the_engine(checkpoint, home, tmp_path):
    tokens = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    arg = ",".join(map(str, tokens))
    for name in ("a.npy", "b.npy"):
        r = _k31c("logits", "--checkpoint", str(checkpoint), "--tokens", arg, "--out",
                  str(tmp_path / name), home=home)
        assert r.returncode == 0, r.stderr
    a_bytes, b_bytes = (tmp_path / "a.npy").read_bytes(), (tmp_path / "b.npy").read_bytes()
    assert a_bytes == b_bytes
    a = np.load(tmp_path / "a.npy")
    assert a.dtype == np.float32 and a.shape == (20, 512)
    want = Engine(load_checkpoint(checkpoint), max_requests=1, max_seq_len=20).prefill_logits(tokens)
    np.testing.assert_allclose(a, want.numpy(), rtol=1e-5, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]  # no temporaries


def test_default_model_made_once_then_generate_streams(home, tmp_path):
    r = _k31c("logits", "--tokens", "256,72,105", "--out", str(tmp_path / "x.npy"), home=home)
    assert r.returncode == 0, r.stderr
    assert "making the tiny model" in r.stderr and (home / "models" / "tiny-seed0" / "config.json").is_file()
    r = _k31c("generate", "--prompt", "Hello", "--max-new-tokens", "4", "--temperature", "0.8",
              "--top-p", "0.9", "--seed", "2", home=home)
    assert r.returncode == 0, r.stderr
    assert "making the tiny model" not in r.stderr
    assert "4 tokens in" in r.stderr and "tokens/s" in r.stderr
    assert r.stdout.endswith("\n")


def test_generate_prints_the_engine_tokens(checkpoint, capsys):
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "héllo", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    tok = ByteTokenizer()
    engine = Engine(load_checkpoint(checkpoint), max_requests=1, max_seq_len=64)
    ids = engine.generate(tok.encode("héllo", add_bos=True), 4)
    text = tok.decode(ids)
    controls = {chr(i) for i in [*range(32), *range(127, 160)]} - {"\n", "\t"}
    shown = "".join(f"\\x{ord(c):02x}" if c in controls else c for c in text)
    assert out == shown + "\n"


def test_bad_checkpoint_reported_without_traceback(checkpoint, home, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}junk")
    r = _k31c("logits", "--checkpoint", str(bad), "--tokens", "1,2", "--out", str(tmp_path / "x.npy"),
              home=home)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"k31c: error: invalid checkpoint {bad}") and "model.safetensors" in r.stderr


BAD_INPUTS = [
    # generate: values and lengths
    (["generate", "--prompt", "", "--max-new-tokens", "4"], "--prompt is empty"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1"),
    (["generate", "--prompt", "x" * 5000, "--max-new-tokens", "4"], "exceeds the model's maximum length 4096"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "5000"],
     "the prompt plus --max-new-tokens (5003 tokens) exceeds the model's maximum length 4096"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature must be >= 0"),
    (["generate", "--prompt", "hi", "--temperature", "1e-300"], "--temperature 1e-300: must be 0 (greedy) or at least"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "argument --temperature: must be a finite number"),
    (["generate", "--prompt", "hi", "--temperature", "inf"], "argument --temperature: must be a finite number"),
    (["generate", "--prompt", "hi", "--top-p", "nan"], "argument --top-p: must be a finite number"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "--prompt", "hi", "--seed", str(2**64)], "argument --seed: 18446744073709551616 is outside 0..18446744073709551615"),
    (["generate", "--prompt", "hi", "--seed", "-1"], "argument --seed: -1 is outside 0.."),
    (["generate", "--checkpoint", "{tmp}/missing", "--prompt", "hi"],
     "--checkpoint {tmp}/missing: checkpoint directory {tmp}/missing does not exist"),
    (["generate", "--checkpoint", "{tmp}/afile", "--prompt", "hi"], "--checkpoint {tmp}/afile is not a directory"),
    (["generate", "--checkpoint", "{tmp}/emptydir", "--prompt", "hi"], "no config.json in the directory"),
    # logits: tokens and --out
    (["logits", "--tokens", "1,2.5", "--out", "{tmp}/x.npy"], "'2.5' is not an integer"),
    (["logits", "--tokens", "1,,2", "--out", "{tmp}/x.npy"], "comma-separated token ids"),
    (["logits", "--tokens", "1,512", "--out", "{tmp}/x.npy"], "ids [512] outside [0, 512)"),
    (["logits", "--tokens", "-1", "--out", "{tmp}/x.npy"], "ids [-1] outside [0, 512)"),
    (["logits", "--tokens", str(10**30), "--out", "{tmp}/x.npy"], f"ids [{10**30}] outside"),
    (["logits", "--tokens", ",".join(["7"] * 4097), "--out", "{tmp}/x.npy"], "(4097 tokens) exceeds"),
    (["logits", "--tokens", "1", "--out", "{tmp}/no/such/dir/x.npy"], "directory {tmp}/no/such/dir does not exist"),
    (["logits", "--tokens", "1", "--out", "{tmp}/emptydir"], "--out {tmp}/emptydir is a directory"),
    (["logits", "--tokens", "1", "--out", "{tmp}/afile/x.npy"], "directory {tmp}/afile is not a directory"),
    (["logits", "--checkpoint", "{tmp}/missing", "--tokens", "1", "--out", "{tmp}/x.npy"],
     "checkpoint directory {tmp}/missing does not exist"),
    (["logits", "--checkpoint", "{tmp}/badcfg", "--tokens", "1", "--out", "{tmp}/x.npy"],
     "unknown key 'surprise'"),
    # init: config, seed, --out
    (["init", "--config", "no-such-preset", "--out", "{tmp}/c"], "neither a preset (tiny, k3.1-pro"),
    (["init", "--config", "{tmp}/badcfg", "--out", "{tmp}/c"], "unknown key 'surprise'"),
    (["init", "--seed", str(2**64), "--out", "{tmp}/c"], "argument --seed: 18446744073709551616 is outside"),
    (["init", "--seed", "x", "--out", "{tmp}/c"], "argument --seed: 'x' is not an integer"),
    (["init", "--out", "{tmp}/full"], "--out {tmp}/full exists and is not empty (--force replaces a checkpoint there)"),
    (["init", "--out", "{tmp}/full", "--force"], "--out {tmp}/full holds files that are not a checkpoint's (f)"),
    (["init", "--out", "{tmp}/afile", "--force"], "--out {tmp}/afile exists and is not a directory"),
    (["init", "--out", "{tmp}/afile/sub"], "{tmp}/afile is not a directory"),
    # info, inspect
    (["info", "--config", "nosuch"], "'nosuch' is neither a preset (tiny, k3.1-pro, bench, kimi-k3, kimi-linear-48b)"),
    (["inspect", "--config", "nosuch"], "'nosuch' is neither a preset (tiny, k3.1-pro"),
    (["inspect", "-o", "{tmp}/no/such/g.svg"], "-o {tmp}/no/such/g.svg: directory {tmp}/no/such does not exist"),
    (["inspect", "--disable", "quantize,nope"], "--disable: 'nope' not in the pipeline"),
    (["inspect", "--step", "verify", "--rows", "1"], "--rows must be at least 2"),
]


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size if p.is_file() else "dir" for p in root.rglob("*")}


@pytest.fixture
def no_loading(monkeypatch):
    """Every check must come before the model is loaded, built or written."""
    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")
    import k31c.checkpoint_save
    import k31c.cli.generate
    import k31c.cli.inspect
    import k31c.cli.logits
    import k31c.graph.sizes
    for module, name in [(k31c.cli.generate, "load_model"), (k31c.cli.logits, "load_model"),
                         (k31c.checkpoint_save, "init_checkpoint"), (k31c.cli.inspect, "_compile"),
                         (k31c.graph.sizes, "parameter_groups")]:
        monkeypatch.setattr(module, name, loaded)


@pytest.mark.parametrize("argv,message", BAD_INPUTS, ids=[" ".join(a)[:50] for a, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_error(argv, message, checkpoint, tmp_path, capsys, monkeypatch, no_loading):
    monkeypatch.setenv("K31C_HOME", str(checkpoint.parent))  # reuse one default model
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "badcfg").mkdir()
    (tmp_path / "badcfg" / "config.json").write_text(
        (checkpoint / "config.json").read_text().replace('{', '{"surprise": 1, ', 1))
    before = _tree(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--checkpoint" not in argv and argv[0] in ("logits", "generate"):
        argv[1:1] = ["--checkpoint", str(checkpoint)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("k31c: error: ") and message.replace("{tmp}", str(tmp_path)) in err, err
    assert err.count("k31c:") == 1 and all(line.startswith("  - ") for line in err.splitlines()[1:]), err
    assert "Traceback" not in err and captured.out == ""
    assert _tree(tmp_path) == before   # nothing written, deleted or left behind


def test_argparse_errors_are_one_line_exit_2(capsys):
    for argv, message in [(["logits", "--tokens", "1"], "the following arguments are required: --out"),
                          (["generate", "--prompt", "x", "--max-new-tokens", "many"], "'many' is not an integer"),
                          (["nosuch"], "invalid choice: 'nosuch'"),
                          ([], "no command given")]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("k31c: error: ") and err.count("\n") == 1 and message in err, err


def test_byte_tokenizer():
    tok = ByteTokenizer(512)
    text = "Grüße, 世界 🙂"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == BOS_ID and all(0 <= i < 256 for i in ids[1:]) and len(ids) == 1 + len(text.encode())
    assert tok.decode(ids + [EOS_ID, 511]) == text
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == text
    assert tok.decode([0xC3]) == "\ufffd"  # an unfinished character becomes U+FFFD
    with pytest.raises(ValueError, match="vocab_size=100"):
        ByteTokenizer(100)


def test_info_prints_full_size_parameter_counts():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "k31c", "info", "--config", "k3.1-pro"],
                         capture_output=True, text=True, check=True).stdout
    assert "93 layers (69 KDA, 24 MLA + indexer)" in out
    assert "indexer" in out and "B parameters" in out


# ---- the machine's limits and damaged weights ------------------------------------------------------

@pytest.mark.parametrize("error,line", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                  "memory: you tried to allocate 640000005120 bytes. Error code 12 (Cannot allocate memory)"),
     "k31c: error: out of memory: DefaultCPUAllocator: can't allocate memory: you tried to allocate "
     "640000005120 bytes. Error code 12 (Cannot allocate memory)"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
     "k31c: error: out of memory: CUDA out of memory. Tried to allocate 20.00 GiB"),
    (MemoryError(), "k31c: error: out of memory"),
])
def test_out_of_memory_is_the_machines_failure(error, line, monkeypatch, capsys):
    import k31c.cli.info

    def fail(args):
        raise error
    monkeypatch.setattr(k31c.cli.info, "run", fail)
    assert main(["info"]) == 1
    assert capsys.readouterr().err == line + "\n"


def test_generate_refuses_a_cache_pool_larger_than_memory(checkpoint, tmp_path, capsys):
    big = tmp_path / "big"
    big.mkdir()
    for f in checkpoint.iterdir():
        text = f.read_bytes()
        if f.name == "config.json":
            text = text.replace(b'"max_seq_len": 4096', b'"max_seq_len": 2147483647')
        (big / f.name).write_bytes(text)
    assert main(["generate", "--checkpoint", str(big), "--prompt", "hi", "--max-new-tokens", "2147483000"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("k31c: error: out of memory: the cache pool for 1 request(s) of up to "
                          "2147483003 tokens needs ") and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def nan_checkpoint(checkpoint, tmp_path_factory):
    """The seed-3 checkpoint with every weight byte 0xFF (NaN)."""
    out = tmp_path_factory.mktemp("nan") / "ckpt"
    out.mkdir()
    for f in checkpoint.iterdir():
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            n = 8 + int.from_bytes(data[:8], "little")   # past the length and the JSON header
            data = data[:n] + b"\xff" * (len(data) - n)
        (out / f.name).write_bytes(data)
    return out


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi", "--max-new-tokens", "3"],
                                  ["generate", "--prompt", "hi", "--temperature", "0.8"],
                                  ["logits", "--tokens", "1,2", "--out", "{tmp}/x.npy"]],
                         ids=["greedy", "sampled", "logits"])
def test_nan_weights_are_a_checkpoint_error(argv, nan_checkpoint, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([argv[0], "--checkpoint", str(nan_checkpoint), *argv[1:]]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == f"k31c: error: invalid checkpoint {nan_checkpoint}:", captured.err
    assert len(lines) == 2 and "are NaN or inf" in lines[1] and "weights hold NaN or inf" in lines[1]
    assert captured.out == "" and list(tmp_path.iterdir()) == []   # no text, no file


@pytest.mark.parametrize("encoding,shown", [("ascii", b"\\ufffd(\\xe9\n"), ("latin-1", b"\\ufffd(\xe9\n")])
def test_generate_text_degrades_to_the_output_encoding(encoding, shown, checkpoint, monkeypatch):
    import io

    def fixed_tokens(self, prompt, n, on_token=None, **kwargs):
        new = [0xC3, 0x28, 0xC3, 0xA9]   # U+FFFD, "(", "é"
        for t in new:
            on_token(t)
        return new
    monkeypatch.setattr(Engine, "generate", fixed_tokens)
    out = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "hi"]) == 0
    out.flush()
    assert out.buffer.getvalue() == shown


def test_generate_with_stdout_closed(checkpoint, monkeypatch, capsys, no_loading):
    monkeypatch.setattr(sys, "stdout", None)    # what Python makes of `k31c generate ... >&-`
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == ("k31c: error: standard output is closed: generate prints its "
                                       "text there\n")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_logits_on_a_full_disk_names_the_cause_and_the_file(checkpoint, capsys):
    assert main(["logits", "--checkpoint", str(checkpoint), "--tokens", "1,2", "--out", "/dev/full"]) == 1
    assert capsys.readouterr().err == "k31c: error: No space left on device: /dev/full\n"


def test_cache_command_names_a_cache_it_cannot_use(tmp_path, monkeypatch, capsys):
    """`k31c cache` on a file, or on a directory it may not read: one line naming the cache, exit 2."""
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    assert main(["cache", "list", "--cache-dir", str(afile)]) == 2
    assert f"k31c: error: the compile cache {afile} is not a directory" in capsys.readouterr().err
    import k31c.compile_cache

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self.root / "x"))
    monkeypatch.setattr(k31c.compile_cache.CompileCache, "entries", refused)
    assert main(["cache", "prune", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"cannot prune the compile cache {tmp_path}: Permission denied ({tmp_path / 'x'})" in err
