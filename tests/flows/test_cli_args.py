"""The `laminar` command line in process: global options before or after the subcommand, "did you
mean" for a mistyped subcommand or option, and `laminar config` showing the values an algorithm's
preset fills in."""

from __future__ import annotations

import re

import pytest

from flows.cli import did_you_mean, main


@pytest.mark.parametrize(
    "argv",
    [
        ["--workspace", "{ws}", "runs"],
        ["runs", "--workspace", "{ws}"],
        ["--workspace={ws}", "runs"],
        ["--workspace", "/elsewhere", "runs", "--workspace", "{ws}"],
    ],
)
def test_workspace_before_or_after_the_subcommand(tmp_path, capsys, argv):
    ws = tmp_path / "ws-given"
    code = main([a.format(ws=ws) for a in argv])
    err = capsys.readouterr().err
    # the empty workspace named is the one read (a later --workspace wins), not ./workspace nor an
    # argparse error
    assert code == 2 and f"no catalog in {ws}" in err, err
    assert "invalid choice" not in err


def test_a_mistyped_subcommand_gets_a_did_you_mean(capsys):
    assert main(["staus"]) == 2
    err = capsys.readouterr().err
    assert (
        "unknown command 'staus' (did you mean 'status'?)" in err and "choose from run, rerun, status" in err
    )
    assert main(["--workspace", "ws", "lineag"]) == 2
    assert "did you mean 'lineage'?" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert "did you mean" not in capsys.readouterr().err  # nothing close: no guess


def test_a_mistyped_option_gets_a_did_you_mean(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--forse", "rl"])
    assert exc.value.code == 2
    assert "unknown option --forse (did you mean '--force'?)" in capsys.readouterr().err
    assert did_you_mean("--worspace", ["--workspace", "--force"]) == " (did you mean '--workspace'?)"


def test_config_prints_the_values_the_preset_fills_in(capsys):
    assert main(["config", "rl.algorithm=dapo", "rl.clip_low=0.1"]) == 0
    rl = re.split(r"\n(?=\S)", capsys.readouterr().out.split("\nrl:\n", 1)[1], maxsplit=1)[0]
    lines = {
        line.split(":")[0].strip(): line.split(":", 1)[1].strip() for line in rl.splitlines() if ":" in line
    }
    from training.objectives import PRESETS

    dapo = PRESETS["dapo"]
    assert (
        lines["clip_high"]
        == f"{dapo.clip_high}  # rl.algorithm=dapo preset"
        == "0.28  # rl.algorithm=dapo preset"
    )
    assert lines["dynamic_sampling"].startswith("true") and lines["loss_agg"].startswith("token_mean")
    assert lines["clip_low"] == "0.1"  # an explicit override is printed as given, with no preset mark
    assert "null" not in lines["clip_high"] + lines["dynamic_sampling"] + lines["overlong_shaping"]
    assert main(["config"]) == 0
    assert "clip_high: 0.2  # rl.algorithm=grpo preset" in capsys.readouterr().out
