"""The CLI's tiny model cache ($K31C_HOME/models): a damaged cache or an unusable home is
named, with what to do, and never overwritten."""
import os
from pathlib import Path

import pytest

import k31c.checkpoint_save as save_mod


def _cli(argv, home: Path, monkeypatch, capsys) -> tuple[int, str]:
    from k31c.cli import main
    monkeypatch.setenv("K31C_HOME", str(home))
    monkeypatch.setattr(save_mod, "init_checkpoint", lambda *a, **k: pytest.fail("the model was made"))
    status = main(argv)
    return status, capsys.readouterr().err


GENERATE = ["generate", "--prompt", "hi", "--max-new-tokens", "1"]


def test_a_corrupt_cached_config_says_how_to_recover(tmp_path, monkeypatch, capsys):
    made = tmp_path / "models" / "tiny-seed0"
    made.mkdir(parents=True)
    (made / "config.json").write_text("{not json")
    status, err = _cli(GENERATE, tmp_path, monkeypatch, capsys)
    assert status == 2 and "not valid JSON" in err, err
    assert f"delete {made} and the next run makes it again" in err


@pytest.mark.parametrize("damage", ["no config", "a file"])
def test_a_damaged_cache_says_what_to_do_not_overwrite(tmp_path, monkeypatch, capsys, damage):
    made = tmp_path / "models" / "tiny-seed0"
    if damage == "a file":
        made.parent.mkdir(parents=True)
        made.write_text("x")
    else:
        made.mkdir(parents=True)
        (made / "model.safetensors").write_bytes(b"x")
    status, err = _cli(GENERATE, tmp_path, monkeypatch, capsys)
    assert status == 2 and err.startswith(f"k31c: error: invalid checkpoint {made}"), err
    assert f"delete {made} and the next run makes it again" in err and "overwrite" not in err


@pytest.mark.parametrize("home_is", ["a file", "not writable"])
def test_an_unusable_k31c_home_is_named(tmp_path, monkeypatch, capsys, home_is):
    home = tmp_path / "home"
    if home_is == "a file":
        home.write_text("x")
        problem = f"{home} is not a directory"
    else:
        home.mkdir()
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: Path(p) != home and real_access(p, mode, **k))
        problem = f"directory {home} is not writable"
    status, err = _cli(GENERATE, home, monkeypatch, capsys)
    assert status == 2, err
    assert err == (f"k31c: error: cannot make k31c's tiny model in {home}/models/tiny-seed0: {problem} "
                   f"(the directory comes from $K31C_HOME={home})\n")
