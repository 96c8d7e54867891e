"""DART with a teacher (issue 54, part 3): ``curation.dart.model`` picks who synthesises the trials."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest

from conf.loader import load_config
from conf.schema import ConfigError, ModelConfig
from core.artifacts import ArtifactRef, hash_tree
from data_curation.dart import DartParams
from data_curation.sampling import dart_sample
from generation.model import (
    build_char_tokenizer,
    build_tiny_model,
    encode_problem,
    encode_response,
    save_model,
)
from rewards.verifier import Verifier
from tasks.dag import STAGE_BY_NAME
from tasks.stages.dart import dart_key, dart_model, dart_teacher_files
from tests.training.rl_fakes import fit
from training.sft import SFTExample, collate

MICRO = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
PROBLEMS = {f"p{i}": (f"{i}+{i}", str(2 * i)) for i in range(1, 5)}
TEMPLATE = "{problem}="


def _taught(tok, seed: int = 0):
    """A micro model fitted to answer every problem of ``PROBLEMS`` as ``#### <answer>``: a teacher
    better than the untrained warm-up model."""
    model = build_tiny_model(MICRO, tok, seed=seed)
    batch = [
        SFTExample(encode_problem(tok, TEMPLATE, p), encode_response(tok, f"#### {a}"))
        for p, a in PROBLEMS.values()
    ]
    ids, attn, labels = collate(batch, tok.pad_token_id)
    return fit(model, ids, labels, steps=150, lr=1e-2, attention_mask=attn)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dart_teacher")
    tok = build_char_tokenizer()
    save_model(build_tiny_model(MICRO, tok, seed=0), tok, root / "warmup")
    save_model(_taught(tok), tok, root / "teacher")
    small = build_char_tokenizer("0123456789+=#")
    save_model(build_tiny_model(MICRO, small, seed=0), small, root / "other")
    ids = list(PROBLEMS)
    pl.DataFrame(
        {
            "prompt_id": ids,
            "problem": [PROBLEMS[i][0] for i in ids],
            "answer": [PROBLEMS[i][1] for i in ids],
            "level": [5] * len(ids),
        }
    ).write_parquet(root / "prompts.parquet")
    pl.DataFrame(  # hard prompts: the warm-up model never solved them
        {"prompt_id": ids, "n": [4] * len(ids), "n_correct": [0] * len(ids), "pass_rate": [0.0] * len(ids)}
    ).write_parquet(root / "attempts.parquet")
    return root


def _dart(root: Path, model: str) -> pl.DataFrame:
    out = root / f"out_{model}"
    out.mkdir()
    with Verifier(timeout_s=5.0) as verifier:
        dart_sample(
            root / model,
            root / "prompts.parquet",
            root / "attempts.parquet",
            out,
            DartParams(strategy="prop2diff", k_u=2, k_p=2, max_trials=4, budget=16, round_size=16),
            max_new_tokens=8,
            temperature=1.0,
            template=TEMPLATE,
            seed=0,
            device="cpu",
            verifier=verifier,
        )
    return pl.read_parquet(out / "dart_stats.parquet")


def test_a_better_teacher_synthesises_more_correct_trials_on_hard_prompts(folders):
    warm, teacher = _dart(folders, "warmup"), _dart(folders, "teacher")
    assert warm["trials"].sum() == 16  # hard prompts spend the whole budget under the warm-up model
    assert teacher["corrects"].sum() >= 6 > warm["corrects"].sum()
    assert (teacher["corrects"] >= 1).sum() == len(PROBLEMS) > (warm["corrects"] >= 1).sum()


def test_dart_model_picks_the_synthesiser_and_refuses_another_tokenizer(folders):
    def ctx(*over):
        return SimpleNamespace(
            cfg=load_config(list(over)), inputs={"model": SimpleNamespace(path=str(folders / "warmup"))}
        )

    assert dart_model(ctx()) == folders / "warmup"
    teacher = ctx("curation.dart.model=teacher", f"teacher.path={folders / 'teacher'}")
    assert dart_model(teacher) == folders / "teacher"
    with pytest.raises(ValueError, match="curation.dart.model=teacher needs the student's tokenizer"):
        dart_model(ctx("curation.dart.model=teacher", f"teacher.path={folders / 'other'}"))
    with pytest.raises(ValueError, match="no model folder"):
        dart_model(ctx("curation.dart.model=teacher", f"teacher.path={folders / 'none'}"))


def test_the_warmup_key_is_unchanged_and_the_teacher_enters_the_key_and_lineage(folders):
    default = load_config([])
    assert "model" not in dart_key(default) and dart_teacher_files(default) == {}
    cfg = load_config(["curation.dart.model=teacher", f"teacher.path={folders / 'teacher'}"])
    assert dart_key(cfg)["model"] == "teacher"
    assert dart_teacher_files(cfg) == {"teacher.path": hash_tree(folders / "teacher")}
    dart = STAGE_BY_NAME["dart"]
    inputs = {k: ArtifactRef(kind="model", sha256=k * 8, path="/x") for k in ("model", "prompts", "attempts")}
    assert dart.key(cfg, inputs) != dart.key(default, inputs)
    assert dart.external_hashes(cfg, None)["teacher.path"] == hash_tree(folders / "teacher")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["curation.dart.model=teacher"], r"curation.dart.model=teacher needs a teacher model"),
        (["curation.dart.model=teacher", "teacher.path=self"], r"needs a teacher model"),
        (["curation.dart.model=rl"], r"curation.dart.model=rl .* single-round"),
        (["curation.dart.model=student"], r"curation.dart.model"),
    ],
)
def test_dart_model_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(overrides)
    assert "\n" not in str(e.value).strip()


def test_rl_reads_dart_data_and_the_teacher_only_when_relift_asks(folders):
    from tasks.dag import stage_inputs
    from tasks.stages.rl import rl_key, teacher_files

    rl = STAGE_BY_NAME["rl"]
    produced = {
        "rft": {"model": ArtifactRef(kind="model", sha256="a" * 8, path="/a")},
        "select": {"selection": ArtifactRef(kind="selection", sha256="b" * 8, path="/b")},
        "data": {"dataset": ArtifactRef(kind="dataset", sha256="c" * 8, path="/c")},
        "dart": {"rft_data": ArtifactRef(kind="rft_data", sha256="d" * 8, path="/d")},
    }
    default = load_config([])
    assert "rft_data" not in stage_inputs(rl, produced, default)
    assert "relift" not in rl_key(default) and "teacher" not in rl_key(default)  # the key as it was
    dart = load_config(["rl.relift.enabled=true", "rl.relift.source=dart"])
    assert stage_inputs(rl, produced, dart)["rft_data"].sha256 == "d" * 8
    assert rl_key(dart)["relift"]["source"] == "dart" and teacher_files(dart) == {}
    teacher = [f"teacher.path={folders / 'teacher'}"]
    relift = load_config(["rl.relift.enabled=true", *teacher])
    assert "rft_data" not in stage_inputs(rl, produced, relift)
    assert teacher_files(relift) == {"teacher.path": hash_tree(folders / "teacher")} and "teacher" in rl_key(
        relift
    )
    dart_only = load_config(["curation.dart.model=teacher", *teacher])  # DART's teacher is DART's input
    assert teacher_files(dart_only) == {} and "teacher" not in rl_key(dart_only)
