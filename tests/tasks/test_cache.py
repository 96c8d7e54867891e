import shutil
from pathlib import Path

from conf.loader import load_config
from tasks import cache
from tasks.cache import make_key, module_closure, source_fingerprint
from tasks.dag import STAGE_BY_NAME, STAGES


def test_closure_follows_project_imports_only():
    names = [n for n, _ in module_closure(("training.rl.stage",))]
    assert "generation.engine" in names and "training.objectives" in names and "generation.model" in names
    assert not any(n.startswith(("torch", "prefect", "tasks", "flows", "conf")) for n in names)
    data_names = [n for n, _ in module_closure(("data_curation.synthetic",))]
    assert not any(n.startswith("training") for n in data_names)


def test_key_parts_say_what_changed():
    a = make_key("rl", {"lr": 1}, {"model": "abc"}, ("training.rl.stage",), 0)
    b = make_key("rl", {"lr": 2}, {"model": "abc"}, ("training.rl.stage",), 0)
    c = make_key("rl", {"lr": 1}, {"model": "abd"}, ("training.rl.stage",), 1)
    assert a.digest != b.digest and b.changed_parts(a) == ["config"]
    assert c.changed_parts(a) == ["inputs", "seed"]
    assert make_key("rl", {"lr": 1}, {"model": "abc"}, ("training.rl.stage",), 0) == a


def test_rl_lr_changes_only_rl_config_hash():
    base, other = load_config([]), load_config(["rl.lr=0.01"])
    changed = [s for s, st in STAGE_BY_NAME.items() if st.config(base) != st.config(other)]
    assert changed == ["rl"]


def test_fingerprint_depends_on_module_set():
    assert source_fingerprint(["data_curation.synthetic"]) != source_fingerprint(["training.rl.stage"])
    assert source_fingerprint(["training.rl.stage"]) == source_fingerprint(["training.rl.stage"])


def test_rl_code_does_not_reach_earlier_stages():
    """Editing the RL objective or engine must not rerun warm-up (DESIGN: only the stage and what follows)."""
    closures = {
        name: {m for m, _ in module_closure(tuple(sorted(st.modules)))} for name, st in STAGE_BY_NAME.items()
    }
    for stage in ("data", "base_model", "warmup"):
        assert not any(m.startswith(("training.rl", "training.objectives")) for m in closures[stage]), stage
    assert "training.objectives" in closures["rl"]
    assert "training.sft" in closures["warmup"] and "training.sft" not in closures["rl"]


def test_history_prompts_keys_only_the_rft_difficulty_stage():
    """``curation.select.history_prompts`` resamples HIVE's history, not the warm-up difficulty DART uses."""
    base, more = load_config([]), load_config(["curation.select.history_prompts=0"])
    warm, rft = STAGE_BY_NAME["difficulty"], STAGE_BY_NAME["difficulty_rft"]
    assert warm.config(base) == warm.config(more)
    assert rft.config(base)["max_prompts"] == base.curation.select.history_prompts == 750
    assert rft.config(more)["max_prompts"] == 0
    # at most what difficulty samples, so a small config scales both down; null follows it
    small = load_config(["curation.difficulty.max_prompts=40"])
    assert rft.config(small)["max_prompts"] == 40
    follows = load_config(["curation.select.history_prompts=null"])
    assert rft.config(follows)["max_prompts"] == follows.curation.difficulty.max_prompts


def _copy_tree(dst: Path) -> Path:
    """The project packages' sources (Python and compiled-code data) under ``dst``."""
    for pkg in cache.PROJECT_PACKAGES:
        for f in (cache.ROOT / pkg).rglob("*"):
            if f.is_file() and (f.suffix == ".py" or f.suffix in cache.CODE_DATA_SUFFIXES):
                target = dst / f.relative_to(cache.ROOT)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
    return dst


def test_editing_the_c_decode_kernel_makes_every_stage_that_runs_it_stale(tmp_path):
    """``generation/kernels/decode.c`` computes each CPU decode step: it is part of the source of every
    stage whose code reaches ``generation.kernels``, and of no other (edited on a copy of the tree)."""
    tree = _copy_tree(tmp_path / "src")
    kernel = tree / "generation" / "kernels" / "decode.c"
    runs_it = {
        s.name
        for s in STAGES
        if "generation.kernels" in {m for m, _ in cache.module_closure(s.modules, tree)}
    }
    assert {"difficulty", "dart", "rl", "eval_rl"} <= runs_it and "data" not in runs_it
    before = {s.name: cache.source_fingerprint(s.modules, tree) for s in STAGES}
    kernel.write_text(kernel.read_text() + "\n/* edited */\n")
    cache.module_closure.cache_clear()
    after = {s.name: cache.source_fingerprint(s.modules, tree) for s in STAGES}
    assert {n for n in before if before[n] != after[n]} == runs_it
    files = cache.source_files(STAGE_BY_NAME["rl"].modules, tree)
    assert files["generation.kernels/decode.c"]["path"] == "generation/kernels/decode.c"


def test_every_package_a_stage_reaches_enters_its_source_fingerprint():
    """A library package left out of ``PROJECT_PACKAGES`` silently drops its files from every key (as
    ``rewards`` and ``environments`` once were: editing the verifier reran nothing)."""
    packages = {p.name for p in cache.ROOT.iterdir() if (p / "__init__.py").exists()}
    reached: set[str] = set()
    for stage in STAGES:
        for _, path in cache.module_closure(tuple(stage.modules)):
            if path.suffix == ".py":
                rel = path.relative_to(cache.ROOT)
                reached |= {
                    n.split(".")[0] for n in cache._imports(path, ".".join(rel.with_suffix("").parts))
                }
    assert reached & packages - {"conf"} <= set(cache.PROJECT_PACKAGES)
    assert {"rewards", "environments"} <= reached  # the stages do reach them
