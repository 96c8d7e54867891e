"""What one decode step, a prefill, an update and a weight copy cost on the simulated hardware:
measured points or a roofline (the formulas are in docs/simulator.md)."""

from __future__ import annotations

import bisect

from conf.simulate import SimModelConfig, SimulateConfig


def weight_bytes(model: SimModelConfig) -> float:
    return model.params_b * 1e9 * model.bytes_per_param


def kv_bytes_per_token(model: SimModelConfig) -> float:
    """``model.kv_bytes_per_token``, or ``2 * layers * kv_heads * head_dim * bytes_per_param`` when 0."""
    return (
        model.kv_bytes_per_token
        or 2.0 * model.layers * model.kv_heads * model.head_dim * model.bytes_per_param
    )


class CostModel:
    """Seconds of work for engines of ``gpus_per_engine`` GPUs and a trainer of ``trainer_gpus``."""

    def __init__(self, cfg: SimulateConfig, gpus_per_engine: int, trainer_gpus: int):
        self.c = cfg.cost
        self.m = cfg.model
        self.tp = gpus_per_engine
        self.trainer_gpus = trainer_gpus
        self.params = self.m.params_b * 1e9
        self.w = weight_bytes(self.m)
        self.kv = kv_bytes_per_token(self.m)
        pts = sorted((float(b), float(s)) for b, s in self.c.decode_points)
        self.pts_b = [b for b, _ in pts]
        self.pts_s = [s for _, s in pts]

    def decode_step_s(self, batch: int, ctx: float) -> float:
        c = self.c
        if self.pts_b:
            b, s = self.pts_b, self.pts_s
            if len(b) == 1:
                t = s[0] * max(1.0, batch / b[0]) if batch > b[0] else s[0]
            else:
                i = min(max(bisect.bisect_left(b, batch), 1), len(b) - 1)
                t = s[i - 1] + (s[i] - s[i - 1]) * (batch - b[i - 1]) / (b[i] - b[i - 1])
                t = max(t, s[0] * 0.5)
            extra_ctx = max(0.0, ctx - c.decode_points_ctx) if c.decode_points_ctx else 0.0
            return t + batch * extra_ctx * self.kv / (c.hbm_gbps * 1e9 * c.mem_eff * self.tp)
        mem = (self.w + batch * ctx * self.kv) / (self.tp * c.hbm_gbps * 1e9 * c.mem_eff)
        comp = 2.0 * self.params * batch / (self.tp * c.flops_tflops * 1e12 * c.mfu_decode)
        tp = c.tp_latency_s * self.m.layers if self.tp > 1 else 0.0
        return c.decode_overhead_s + tp + max(mem, comp)

    def prefill_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        c = self.c
        if c.prefill_s_per_token > 0:
            return c.prefill_overhead_s + tokens * c.prefill_s_per_token
        comp = 2.0 * self.params * tokens / (self.tp * c.flops_tflops * 1e12 * c.mfu_prefill)
        mem = self.w / (self.tp * c.hbm_gbps * 1e9 * c.mem_eff)
        return c.prefill_overhead_s + max(comp, mem)

    def train_s(self, tokens: int, ctx_tokens: float) -> float:
        """One update on ``tokens`` response tokens whose mean context is ``ctx_tokens``."""
        c = self.c
        if c.train_s_per_token > 0:
            return c.train_step_overhead_s + tokens * c.train_s_per_token
        attn = 12.0 * self.m.layers * self.m.hidden * ctx_tokens / 2.0
        flops = tokens * (c.train_flops_per_token * self.params + attn)
        return c.train_step_overhead_s + flops / (self.trainer_gpus * c.flops_tflops * 1e12 * c.mfu_train)

    def publish_stall_s(self) -> float:
        return self.w / (self.trainer_gpus * self.c.d2h_gbps * 1e9)

    def relay_arrival_s(self, hop: int) -> float:
        return self.w / (self.c.relay_gbps * 1e9) + hop * self.c.relay_hop_s

    def pull_s(self) -> float:
        return self.w / (self.tp * self.c.h2d_gbps * 1e9) + self.c.pull_overhead_s

    def auto_capacity(self, mean_ctx: float, max_capacity: int) -> int:
        free = (self.c.gpu_mem_gb * 1e9 * self.tp - self.w) * self.c.kv_mem_share
        if free <= 0:
            raise ValueError(
                f"{self.m.name} does not fit {self.tp} GPU(s) of {self.c.gpu_mem_gb:g} GB: "
                "raise cluster.gpus_per_engine"
            )
        return max(1, min(max_capacity, int(free / (self.kv * max(1.0, mean_ctx)))))
