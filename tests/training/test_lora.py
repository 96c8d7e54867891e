"""LoRA through the pipeline without Ray: config, adapter-only training on a frozen base, PEFT folders,
published adapters merged into the sampler, and the rollout-equals-trainer check in the in-process
synchronous loop (with its negative control: an adapter that never reaches the sampler fails it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conf.schema import ConfigError, EngineOptions, LoraConfig, RLConfig, RolloutConfig
from generation.adapter import SCALING_KEY, base_dir, is_adapter_dir, merge_adapter, sequence_logprobs
from generation.model import encode_prompt, load_model
from generation.records import PromptItem
from tests.training.lora_probe import (
    EvenLengthVerifier,
    check_rollouts_match,
    probe_tokens,
    versions_differ,
    write_base_and_adapter,
)
from training.objectives import PRESETS
from training.rl.sections import RLSections


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_base_and_adapter(tmp_path_factory.mktemp("lora"))


def test_lora_is_off_by_default_and_typos_fail_at_config_time():
    from conf.loader import load_config

    assert load_config([]).model.lora.enabled is False
    cfg = load_config(["model.lora.enabled=true", "model.lora.rank=8", "model.lora.stages=[rft,rl]"])
    assert cfg.model.lora.on("rl") and not cfg.model.lora.on("warmup") and cfg.model.lora.rank == 8
    for bad, words in (
        (["model.lora.rnak=4"], "unknown config key 'model.lora.rnak'"),
        (["model.lora.target_modules=[q_prj]"], "model.lora.target_modules='q_prj'"),
        (["model.lora.stages=[sft]"], "model.lora.stages[0]='sft'"),
        (["model.lora.rank=0"], "model.lora.rank=0 must be > 0"),
        (["model.lora.dropout=1.0"], "model.lora.dropout=1.0"),
    ):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
            load_config(bad)


def test_sft_trains_only_the_adapter_and_writes_a_peft_folder(dirs, tmp_path):
    from peft import PeftModel

    from training.lora import load_trainable, save_trained, trainable_parameters
    from training.sft import SFTExample, train_sft

    base, _ = dirs
    model, tok, got_base = load_trainable(base, LoraConfig(enabled=True, rank=4), "warmup", seed=0)
    assert got_base == base
    frozen = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    n_train = sum(p.numel() for p in trainable_parameters(model))
    assert 0 < n_train < sum(p.numel() for p in model.parameters()) / 4
    ex = [
        SFTExample(
            encode_prompt(tok, "1+2="),
            tuple(tok("3", add_special_tokens=False)["input_ids"]) + (tok.eos_token_id,),
        )
    ] * 4
    m = train_sft(
        model,
        ex,
        steps=6,
        batch_size=4,
        lr=1e-2,
        warmup_steps=1,
        weight_decay=0.1,
        max_grad_norm=1.0,
        pad_id=tok.pad_token_id,
        seed=0,
    )
    assert m["sft_loss_last"] < m["sft_loss_first"]
    after = model.get_base_model().state_dict()
    assert all(torch.equal(frozen[k], after[k]) for k in frozen), "the frozen base moved"
    out = tmp_path / "ckpt"
    save_trained(model, tok, out)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not any(p.suffix == ".bin" for p in out.iterdir())
    assert is_adapter_dir(out) and base_dir(out) == base.resolve()
    # peft's own loader takes it, and gives the trained function; load_model gives it merged
    seq = probe_tokens(tok)
    peft_model = PeftModel.from_pretrained(load_model(base)[0], str(out))
    trained = sequence_logprobs(model, seq)
    np.testing.assert_allclose(sequence_logprobs(peft_model, seq), trained, atol=1e-5)
    np.testing.assert_allclose(sequence_logprobs(load_model(out)[0], seq), trained, atol=1e-5)


def test_a_saved_adapter_config_is_the_same_bytes_in_every_process(dirs, tmp_path):
    """PEFT writes ``target_modules`` in set order, which follows the process's string-hash seed; the
    saved file lists them sorted, so an adapter's folder (and artifact sha256) does not depend on it.
    Seven modules: an unsorted set order passes by chance once in 5,040 processes."""
    from peft import PeftModel

    from training.lora import load_trainable, save_trained

    cfg = LoraConfig(enabled=True, rank=4)
    assert len(cfg.target_modules) == 7
    model, tok, _ = load_trainable(dirs[0], cfg, "warmup", seed=0)
    save_trained(model, tok, tmp_path / "a")
    saved = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert saved["target_modules"] == sorted(cfg.target_modules)
    # PEFT reads the sorted list back as the same adapter
    again = PeftModel.from_pretrained(load_model(dirs[0])[0], str(tmp_path / "a"))
    assert again.peft_config["default"].target_modules == set(cfg.target_modules)


def test_sft_optimizer_state_covers_only_adapter_parameters(dirs):
    from training.lora import load_trainable
    from training.rl.trainer import PolicyTrainer

    model, tok, _ = load_trainable(dirs[0], LoraConfig(enabled=True, rank=4), "rl", seed=0)
    trainer = PolicyTrainer.from_config(
        model, PRESETS["grpo"], RLConfig(), pad_id=tok.pad_token_id, device="cpu"
    )
    in_opt = {id(p) for g in trainer.opt.param_groups for p in g["params"]}
    names = [n for n, p in model.named_parameters() if id(p) in in_opt]
    assert names and all("lora_" in n for n in names)
    published = trainer.publish().state
    assert SCALING_KEY in published and all("lora_" in k for k in published if k != SCALING_KEY)


def test_merging_a_published_adapter_equals_peft_and_never_accumulates(dirs):
    from training.lora import adapter_state, continue_adapter, sampling_copy

    model, tok, _ = continue_adapter(dirs[1])
    seq = probe_tokens(tok)
    sampler = sampling_copy(model)
    bare = sequence_logprobs(sampler, seq)
    state = adapter_state(model)
    for _ in range(3):  # the same version merged again gives the same weights (from the kept W0)
        merge_adapter(sampler, state)
    np.testing.assert_allclose(sequence_logprobs(sampler, seq), sequence_logprobs(model, seq), atol=1e-5)
    assert max(abs(a - b) for a, b in zip(bare, sequence_logprobs(sampler, seq))) > 1e-2
    half = {k: v for k, v in state.items() if "lora_B" not in k}
    with pytest.raises(KeyError, match="lora_A or lora_B missing"):
        merge_adapter(sampler, half)


def _sync_probe(adapter_dir, steps=3):
    """The local driver from ``adapter_dir``; at every weight pull, the sampler's log-probs of the
    probe against the trainer's for the version the sampler says it holds."""
    from generation.adapter import sequence_logprobs as lp_of
    from generation.model import load_tokenizer
    from training.rl.drivers.local import LocalDriver

    tok = load_tokenizer(adapter_dir)
    seq = probe_tokens(tok)
    trainer_lp: dict[int, list[float]] = {0: lp_of(load_model(adapter_dir)[0], seq)}  # PEFT's own merge
    seen: list[tuple[str, int, list[float]]] = []

    class Probing(LocalDriver):
        def _pull(self, min_version):
            out = super()._pull(min_version)
            trainer_lp[self.trainer.version] = lp_of(self.trainer.model, seq)
            seen.append(("sampler", self.engine.version, lp_of(self.engine.model, seq)))
            return out

    prompts = [PromptItem(f"p{i}", f"{i}+1", str(i + 1), encode_prompt(tok, f"{i}+1="), 1) for i in range(8)]
    rl = RLConfig(
        steps=steps, prompts_per_step=4, group_size=4, lr=2e-2, max_new_tokens=6, micro_batch_tokens=0
    )
    Probing(
        adapter_dir, prompts, EvenLengthVerifier(), PRESETS["grpo"], RLSections(rl, seed=0), device="cpu"
    ).run()
    return trainer_lp, seen


def test_sync_loop_sampler_equals_trainer_after_every_lora_update(dirs):
    trainer_lp, seen = _sync_probe(dirs[1], steps=4)  # the batches of updates 1-4 pull versions 0-3
    versions_differ(trainer_lp)
    assert [v for _, v, _ in seen] == [0, 1, 2, 3]
    assert check_rollouts_match(trainer_lp, seen) == 3


def test_negative_control_an_adapter_dropped_from_the_publish_fails_the_check(dirs, monkeypatch):
    from training.rl.trainer import PolicyTrainer

    original = PolicyTrainer.publish

    def drop_adapter(self):  # verl's bug: the version moves, the adapter never reaches the sampler
        update = original(self)
        return type(update)(
            kind=update.kind,
            version=update.version,
            state={k: v for k, v in update.state.items() if k == SCALING_KEY},
        )

    monkeypatch.setattr(PolicyTrainer, "publish", drop_adapter)
    trainer_lp, seen = _sync_probe(dirs[1], steps=2)
    with pytest.raises(AssertionError, match="says it holds version"):
        check_rollouts_match(trainer_lp, seen)


def test_rl_stage_writes_an_adapter_with_the_base_from_the_lineage(dirs, tmp_path):
    """rl() from a full model with LoRA on: a fresh adapter trains, the output is a PEFT folder whose
    base is the model it started from."""
    import polars as pl

    from training.rl.stage import rl

    base, _ = dirs
    tok = load_model(base)[1]
    pl.DataFrame(
        {
            "prompt_id": [f"p{i}" for i in range(8)],
            "problem": [f"{i}+1" for i in range(8)],
            "answer": [str(i + 1) for i in range(8)],
            "level": [1] * 8,
        }
    ).write_parquet(tmp_path / "p.parquet")
    out = tmp_path / "out"
    out.mkdir()
    rl(
        base,
        tmp_path / "p.parquet",
        RLSections(
            RLConfig(
                steps=2,
                prompts_per_step=4,
                group_size=4,
                lr=2e-2,
                max_new_tokens=6,
                eval_every=0,
                micro_batch_tokens=0,
            ),
            seed=0,
            lora=LoraConfig(enabled=True, rank=4, stages=["rl"]),
        ),
        template="{problem}=",
        device="cpu",
        out_dir=out,
        reward=EvenLengthVerifier(),
    )
    assert is_adapter_dir(out) and base_dir(out) == base.resolve()
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and not (out / "model.safetensors").exists()
    seq = probe_tokens(tok)
    assert (
        max(
            abs(a - b)
            for a, b in zip(
                sequence_logprobs(load_model(out)[0], seq), sequence_logprobs(load_model(base)[0], seq)
            )
        )
        > 1e-4
    )


def test_sync_resume_restores_adapter_optimizer_and_rng(dirs, tmp_path):
    """A run stopped after its step-1 checkpoint and resumed ends with the same adapter as the
    uninterrupted run: the adapter, its optimizer state and the RNGs all came back."""
    from generation.model import load_tokenizer
    from training.lora import adapter_state
    from training.rl.drivers.local import LocalDriver

    def run(steps, ckpt):
        tok = load_tokenizer(dirs[1])
        prompts = [
            PromptItem(f"p{i}", f"{i}+1", str(i + 1), encode_prompt(tok, f"{i}+1="), 1) for i in range(8)
        ]
        rl = RLConfig(
            steps=steps,
            prompts_per_step=4,
            group_size=4,
            lr=2e-2,
            max_new_tokens=6,
            micro_batch_tokens=0,
            checkpoint_every=1,
        )
        driver = LocalDriver(
            dirs[1],
            prompts,
            EvenLengthVerifier(),
            PRESETS["grpo"],
            RLSections(rl, seed=0),
            device="cpu",
            state_dir=ckpt,
        )
        driver.run()
        return adapter_state(driver.final_model)

    whole = run(3, tmp_path / "a")
    run(2, tmp_path / "b")  # checkpoints after step 1 (never after the last step), then "stops"
    from safetensors import safe_open

    from training.rl.checkpoint import latest_checkpoint

    with safe_open(str(latest_checkpoint(tmp_path / "b" / "checkpoints") / "model.safetensors"), "np") as f:
        saved = list(f.keys())
    assert saved and all("lora_" in k for k in saved), (
        "a LoRA checkpoint holds the adapters, not the frozen base"
    )
    resumed = run(3, tmp_path / "b")
    assert whole.keys() == resumed.keys()
    for k in whole:
        np.testing.assert_allclose(resumed[k], whole[k], atol=1e-6, err_msg=k)


def test_every_built_in_engine_kind_samples_the_same_tokens_under_an_adapter_version(dirs):
    """A published adapter applied by the in-process engine, the static-slot engine and the engine in a
    worker process (through the safetensors wire path) gives the same sampled tokens, and different ones
    from the bare base: the adapter reaches every engine kind the rollouts run."""
    from generation.engine import Engine
    from generation.engines import make_engine
    from generation.records import GenRequest
    from training.lora import adapter_state, continue_adapter

    base, adapter = dirs
    model, tok, _ = continue_adapter(adapter)
    state = adapter_state(model)
    reqs = [GenRequest(PromptItem(f"p{i}", "", "", encode_prompt(tok, f"{i}+{i}=")), 0) for i in range(6)]

    def sample(engine, st):
        if st is not None:
            engine.load_state(st, 1)
        engine.submit(reqs)
        out = []
        while len(out) < len(reqs):
            out += engine.step(8)
        return {t.prompt.prompt_id: t.response_tokens for t in out}

    opts = EngineOptions(capacity=8, max_new_tokens=12, seed=3)
    local = sample(Engine(load_model(base)[0], tok, opts), state)
    assert local != sample(Engine(load_model(base)[0], tok, opts), None)
    static = EngineOptions(capacity=8, max_new_tokens=12, seed=3, rollout=RolloutConfig(static_cache=True))
    assert sample(Engine(load_model(base)[0], tok, static, static_width=24), state) == local
    process = EngineOptions(
        capacity=8, max_new_tokens=12, seed=3, rollout=RolloutConfig(engine="torch-process")
    )
    proc = make_engine(str(base), process, env={"OMP_NUM_THREADS": "1"})
    try:
        assert sample(proc, state) == local
    finally:
        proc.close()


def test_export_writes_the_adapter_merged_into_its_base(dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from core.workspace import Workspace
    from tasks.checkpoint_eval import EvalInputError
    from tasks.export import export_checkpoint, parse_export_args

    base, adapter = dirs
    assert parse_export_args([f"out={tmp_path / 'm'}", f"ckpt={adapter}"]) == (
        str(adapter),
        str(tmp_path / "m"),
    )
    for bad in (["ckpt=x"], ["ckpt=x", "out=y", "out=z"], ["ckpt=x", "dir=y"]):
        with pytest.raises(EvalInputError):
            parse_export_args(bad)
    done = export_checkpoint(Workspace.at(tmp_path / "ws"), str(adapter), tmp_path / "m")
    assert done["adapter"] and done["base"] == str(base.resolve())
    assert not (tmp_path / "m" / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), use_safetensors=True)
    adapted, tok = load_model(adapter)
    seq = probe_tokens(tok)
    np.testing.assert_allclose(sequence_logprobs(plain, seq), sequence_logprobs(adapted, seq), atol=1e-5)
    with pytest.raises(EvalInputError, match="not empty"):
        export_checkpoint(Workspace.at(tmp_path / "ws"), str(adapter), tmp_path / "m")


def test_the_ray_runtime_final_adapter_state_is_written_as_the_start_adapters_peft_folder(dirs, tmp_path):
    """What the RL stage does with the Laminar runtime's final (published) adapter state."""
    from training.lora import adapter_from_state, adapter_state, continue_adapter

    model, tok, _ = continue_adapter(dirs[1])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n:
                p.mul_(1.5)
    adapter_from_state(dirs[1], adapter_state(model), tmp_path / "out")
    assert base_dir(tmp_path / "out") == dirs[0].resolve()
    seq = probe_tokens(tok)
    np.testing.assert_allclose(
        sequence_logprobs(load_model(tmp_path / "out")[0], seq), sequence_logprobs(model, seq), atol=1e-5
    )
