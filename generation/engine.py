"""The built-in rollout engine: batched sampling with a KV cache, driving the model directly.

It records the behaviour log-prob of every sampled token (under the temperature-scaled
distribution it sampled from) and the weight version that produced it. Any Hugging Face causal LM
works; the decode loop is a plain ``forward(past_key_values=...)`` loop, which costs far less per
step than ``generate`` for small models.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from generation.records import GenRequest, PromptItem, Trajectory, WeightsUpdate


class TorchEngine:
    def __init__(self, model, tokenizer, device: str = "cpu", batch_size: int = 256):
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.batch_size = batch_size
        self.version = 0
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def load_weights(self, update: WeightsUpdate) -> None:
        """Version-atomic: every parameter is replaced (strict names), or a LoRA adapter version merged
        into the kept base (``generation.adapter``), before the version moves."""
        from generation.adapter import load_published

        load_published(self.model, update.state)
        self.version = update.version

    def generate(self, requests: Sequence[GenRequest], max_new_tokens: int, temperature: float,
                 generator: torch.Generator, progress=None) -> list[Trajectory]:
        """Sample one response per request, in batches of ``batch_size``; output order = input order."""
        out: list[Trajectory] = []
        for start in range(0, len(requests), self.batch_size):
            chunk = list(requests[start:start + self.batch_size])
            out.extend(self._generate_batch(chunk, max_new_tokens, temperature, generator))
            if progress is not None:
                progress.update(len(chunk))
        return out

    @torch.inference_mode()
    def prompt_entropy(self, prompts: Sequence[PromptItem]) -> list[float]:
        """HIVE's prompt entropy V(x): the mean, over prompt positions 2..L, of the full-vocabulary
        entropy of the current policy's next-token distribution (temperature 1). One forward pass,
        no generation."""
        out: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start:start + self.batch_size]
            width = max(len(p.prompt_tokens) for p in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, p in enumerate(chunk):  # right padding: positions need no shift
                ids[i, :len(p.prompt_tokens)] = torch.tensor(p.prompt_tokens)
                attn[i, :len(p.prompt_tokens)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            ent = -(logp.exp() * logp).nan_to_num().sum(-1).cpu()  # [B, width-1]: predicting tokens 2..width
            mask = attn[:, 1:].float()
            out.extend((ent * mask).sum(1).div(mask.sum(1).clamp(min=1)).tolist())
        return out

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenRequest], max_new_tokens: int, temperature: float,
                        generator: torch.Generator) -> list[Trajectory]:
        from transformers import DynamicCache

        prompts = [r.prompt.prompt_tokens for r in requests]
        bsz, plen = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((bsz, plen), self.pad_id, dtype=torch.long)
        attn = torch.zeros((bsz, plen), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps every sequence's next token at the end
            input_ids[i, plen - len(p):] = torch.tensor(p)
            attn[i, plen - len(p):] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        tokens = torch.empty((bsz, max_new_tokens), dtype=torch.long)
        logps = torch.zeros((bsz, max_new_tokens))
        ent_sum = torch.zeros(bsz)
        lengths = torch.full((bsz,), max_new_tokens, dtype=torch.long)
        done = torch.zeros(bsz, dtype=torch.bool)
        step_ids, step_pos = input_ids, positions
        for t in range(max_new_tokens):
            logits = self.model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                                past_key_values=cache, use_cache=True).logits[:, -1, :]
            logprobs = torch.log_softmax(logits.float() / temperature, dim=-1).cpu()
            probs = logprobs.exp()
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            ent_sum += torch.where(done, 0.0, -(probs * logprobs).nan_to_num().sum(-1))
            tokens[:, t] = nxt
            logps[:, t] = logprobs.gather(1, nxt[:, None]).squeeze(1)
            newly = (nxt == self.eos_id) & ~done
            lengths[newly] = t + 1
            done |= newly
            if bool(done.all()):
                break
            step_ids = nxt[:, None].to(self.device)
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((bsz, 1), dtype=attn.dtype, device=self.device)], dim=1)
        mean_ent = (ent_sum / lengths.clamp(min=1)).tolist()
        return [self._trajectory(r, tokens[i, :lengths[i]], logps[i, :lengths[i]], bool(done[i]), mean_ent[i])
                for i, r in enumerate(requests)]

    def _trajectory(self, req: GenRequest, toks: torch.Tensor, logps: torch.Tensor, finished: bool,
                    mean_entropy: float) -> Trajectory:
        ids = toks.tolist()
        body = ids[:-1] if finished else ids
        return Trajectory(kind="trajectory", prompt=req.prompt, sample_idx=req.sample_idx,
                          response_tokens=tuple(ids), behaviour_logprobs=tuple(np.asarray(logps, dtype=np.float64).tolist()),
                          version=self.version, finished=finished,
                          text=self.tokenizer.decode(body, skip_special_tokens=True), mean_entropy=mean_entropy)
