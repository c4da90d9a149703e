"""The model runner: turns a `SchedulerOutput` into one flat batch, runs the model, samples.

It keeps its own copy of each live request (token ids, block table) in persistent numpy
arrays, updated from the scheduler's per-step diffs, so a step's inputs are built with a
few vectorised gathers instead of per-token Python work. On CUDA the KV pool is sized from
free device memory after a profiling forward, host-to-device copies are pinned and
asynchronous. All-decode steps replay graphs (`engine/decode_graphs.py`): CUDA graphs, or on the
CPU graphs of the C kernels. With `kv_cache_dtype="fp8"` the per-layer KV scales are
calibrated first, before the pool is sized and before any graph captures them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig

from engine import quantization
from engine.attention import (
    FP8_DTYPE,
    FP8_MAX,
    CommonAttentionMetadata,
    KVCacheSpec,
    default_attn_backend,
    get_attn_backend,
    set_forward_context,
)
from engine.config import EngineConfig
from engine.decode_graphs import (
    CpuDecodeGraphs,
    CudaDecodeGraphs,
    DecodeGraphs,
    capture_sizes,
)
from engine.kernels import cpu_attention
from engine.kernels.cpu_build import cpu_bf16_unit
from engine.loader import load_model
from engine.models.layers import model_kernels
from engine.models.llama import head_dim_of
from engine.outputs import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from engine.request import SamplingParams
from engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_grammar_mask,
    argmax_rows,
    gather_logprobs,
)
from engine.spec_decode import auto_disable_by_batch_size
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.rejection_sampler import rejection_sample

logger = logging.getLogger("kvrail.model_runner")

# Prompt logprobs take logits of every prompt row: a 2048-token prefill would hold 0.4-1.2 GB
# of fp32 logits (vocab 49k-152k) at once, so rows go through in slices of this many (40-160
# MB per slice for the logits, as much again for their log_softmax).
_PROMPT_LOGPROBS_ROWS = 256


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 matmuls run 2.3-2.6x faster than fp32 on CPUs with AVX512-BF16 (measured on
        # model-shaped matrices); parity with HF is checked in fp32, which stays available.
        fast_bf16 = device.type == "cuda" or cpu_bf16_unit() is not None
        return torch.bfloat16 if fast_bf16 else torch.float32
    return getattr(torch, name)  # EngineConfig's dtype names are torch's


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, attn_backend: str, device: torch.device
) -> torch.dtype:
    """`auto`: the model dtype; `bfloat16`: bf16 storage under a float32 or bfloat16 model
    (every backend reads it into the model dtype); `fp8` / `fp8_e4m3`: float8 e4m3 with
    per-layer scales.

    The triton kernels convert to and from fp8 with instructions of compute capability 8.9+
    (Ada, Hopper): refused here, at startup, on older GPUs.
    """
    if name == "auto":
        return model_dtype
    if name == "bfloat16":
        if model_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"kv_cache_dtype='bfloat16' needs dtype float32 or bfloat16, the model runs in "
                f"{str(model_dtype).removeprefix('torch.')}: use kv_cache_dtype='auto'"
            )
        return torch.bfloat16
    if attn_backend == "triton" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={name!r} with the triton attention backend needs a GPU with "
                f"fp8 support (compute capability >= 8.9), this one is "
                f"{capability[0]}.{capability[1]}: use kv_cache_dtype='auto'"
            )
    return FP8_DTYPE


@dataclass
class CachedRequestState:
    req_id: str
    row: int  # row in the persistent token / block-table arrays; -1 while preempted
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None  # set for seeded requests; lives across preemptions
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs computed so far (entry j: position j + 1); None when not asked or
    # already returned. Kept across a preemption, so recomputed rows are not redone.
    prompt_logprobs: list[LogprobsEntry] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        max_model_len: int | None,
        eos_token_id: int | None,
        calibration_token_ids: list[int],
    ) -> None:
        """`calibration_token_ids`: the tokenized calibration text (`engine.calibration`), what
        quantized weights and an fp8 KV cache are calibrated on."""
        self.config = config
        self.eos_token_id = eos_token_id
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        head_dim = head_dim_of(AutoConfig.from_pretrained(model_dir))
        backend = config.attention_backend
        if backend == "auto":
            backend = default_attn_backend(self.device, self.dtype, head_dim)
        elif backend == "cpu" and not cpu_attention.supports_head_dim(head_dim):
            raise ValueError(
                f"attention_backend='cpu' takes head_dim 16, 32, ..., 256, the model has "
                f"{head_dim}: use attention_backend='torch'"
            )
        self.attn_backend = get_attn_backend(backend)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, backend, self.device
        )
        torch.manual_seed(config.seed)
        self.block_size = config.block_size
        self._load_model(model_dir, max_model_len, calibration_token_ids)
        self.kv_cache_spec: KVCacheSpec = dataclasses.replace(
            self.model.get_kv_cache_spec(), dtype=self.kv_cache_dtype
        )
        logger.info(
            "KV cache dtype: %s (kv_cache_dtype=%r)", self.kv_cache_dtype, config.kv_cache_dtype
        )
        if self.kv_cache_dtype == FP8_DTYPE:
            self.calibrate_kv_scales(calibration_token_ids)
        self.max_num_reqs = config.max_num_seqs
        self.max_num_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.requests: dict[str, CachedRequestState] = {}
        self.free_rows = list(range(self.max_num_reqs - 1, -1, -1))
        self.token_ids_cpu = np.zeros((self.max_num_reqs, self.max_model_len), dtype=np.int64)
        self.block_table_cpu = np.zeros(
            (self.max_num_reqs, self.max_num_blocks_per_req), dtype=np.int32
        )
        self.sampler = Sampler()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_graphs: DecodeGraphs | None = None
        self.spec_config = spec = config.speculative_config
        self.proposer: NgramProposer | DraftModelProposer | None = None
        # Steps with at least this many requests propose nothing (None: never off).
        self.disable_by_batch_size: int | None = None
        if spec is not None:
            self.disable_by_batch_size = spec.disable_by_batch_size
            if spec.disable_by_batch_size == "auto":
                self.disable_by_batch_size = auto_disable_by_batch_size(
                    self.device, self.dtype, config.quantization
                )
            logger.info("speculation off in steps of %s+ requests", self.disable_by_batch_size)
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        elif spec is not None:
            self.proposer = DraftModelProposer(self, spec.model, spec.num_speculative_tokens)

    def _load_model(
        self, model_dir: Path, max_model_len: int | None, calibration_token_ids: list[int]
    ) -> None:
        """Load the model; with `quantization`, from the quantized cache, or calibrate on
        `calibration_token_ids`, quantize and fill the cache."""
        method = quantization.get_linear_method(
            self.config.quantization,
            model_kernels(self.attn_backend.name),
            self.device,
            self.dtype,
        )
        cached = None
        if self.config.quantization is not None:
            cached = quantization.cache_dir(
                model_dir, self.config.quantization, calibration_token_ids
            )
        hit = cached is not None and quantization.is_cached(cached)
        self.model, self.hf_config = load_model(
            model_dir, self.dtype, self.device, self.attn_backend, method, cached if hit else None
        )
        self.vocab_size = self.hf_config.vocab_size
        self.max_model_len = max_model_len or min(
            getattr(self.hf_config, "max_position_embeddings", 8192), 8192
        )
        if cached is not None and not hit:
            start = time.perf_counter()
            quantization.quantize_model(
                self.model,
                lambda: self.model.compute_logits(
                    self._prefill_forward(calibration_token_ids, self.dtype)[0]
                ),
            )
            quantization.save_quantized(self.model, cached)
            logger.info(
                "quantized to %s in %.1f s (cached in %s)",
                self.config.quantization,
                time.perf_counter() - start,
                cached,
            )
        self.model.process_weights()

    @torch.inference_mode()
    def _prefill_forward(
        self, token_ids: list[int], cache_dtype: torch.dtype
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The model over `token_ids` as fresh prompts, on a scratch KV cache in
        `cache_dtype`: the final hidden states, and per layer the k and v it stored,
        `[num_tokens, num_kv_heads, head_dim]` each, in token order."""
        positions, common, kv_caches = self._dummy_prefill(len(token_ids), cache_dtype)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        with set_forward_context(self.attn_backend.build(common)):
            hidden_states = self.model(input_ids, positions)
        slots = common.slot_mapping.long()
        stored = [tuple(c.flatten(0, 1)[slots] for c in caches) for caches in kv_caches]
        return hidden_states, stored

    def num_kv_blocks_for(self, memory_bytes: int) -> int:
        """Blocks that fit `memory_bytes`: a block id costs its KV in every layer of the
        model, and of the draft model when there is one."""
        bytes_per_block = self.kv_cache_spec.bytes_per_block(self.block_size)
        if isinstance(self.proposer, DraftModelProposer):
            bytes_per_block += self.proposer.kv_cache_spec.bytes_per_block(self.block_size)
        return memory_bytes // bytes_per_block

    def determine_num_kv_blocks(self) -> int:
        """KV pool size: `kv_cache_memory_bytes` on CPU, profiled free memory on CUDA."""
        if self.device.type != "cuda":
            return self.num_kv_blocks_for(self.config.kv_cache_memory_bytes)
        return self.num_kv_blocks_for(self._profile_kv_cache_bytes())

    def _dummy_prefill(
        self, num_tokens: int, cache_dtype: torch.dtype
    ) -> tuple[torch.Tensor, CommonAttentionMetadata, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Positions and metadata of `num_tokens` prompt tokens, as requests of at most
        `max_model_len` tokens, over a scratch KV cache in `cache_dtype` bound to the model
        (rebound later); returns that cache too."""
        seq_lens = torch.tensor(
            [
                min(self.max_model_len, num_tokens - s)
                for s in range(0, num_tokens, self.max_model_len)
            ],
            dtype=torch.int32,
        )
        blocks_per_req = -(-int(seq_lens.max()) // self.block_size)
        block_table = torch.arange(len(seq_lens) * blocks_per_req, dtype=torch.int32)
        block_table = block_table.view(len(seq_lens), blocks_per_req)
        spec = dataclasses.replace(self.model.get_kv_cache_spec(), dtype=cache_dtype)
        kv_caches = spec.allocate(block_table.numel(), self.block_size, self.device)
        self.model.bind_kv_cache(kv_caches)
        positions = torch.cat([torch.arange(n) for n in seq_lens.tolist()])
        token_req = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens.long())
        blocks = block_table[token_req, positions // self.block_size].long()
        query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), seq_lens.cumsum(0).int()])
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(self.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens.to(self.device),
            seq_lens_cpu=seq_lens,
            block_table=block_table.to(self.device),
            slot_mapping=(blocks * self.block_size + positions % self.block_size).to(self.device),
            num_reqs=len(seq_lens),
            num_actual_tokens=num_tokens,
            max_query_len=int(seq_lens.max()),
            block_size=self.block_size,
        )
        return positions.to(self.device), common, kv_caches

    @torch.inference_mode()
    def calibrate_kv_scales(self, token_ids: list[int]) -> None:
        """Static per-layer fp8 parameters: run `token_ids` as a prompt over a scratch cache
        in the model dtype, then set each attention layer's `k_shift` to the mean of the k
        it stored (after rotary), per kv head and channel, and `k_scale` (`v_scale`) to
        2 * max |k - k_shift| (|v|) / 448.

        The shift (see `engine/attention`): measured on SmolLM2 fp32, perplexity x1.0141 ->
        x1.0065 (K's own error: x1.028 with K alone quantized and unshifted, x1.016 to x1.029
        with its scale multiplied by 0.75 to 16, no trend, so no static scale removes it;
        x1.0006 with V alone). The headroom of 2 keeps other texts from saturating: on
        SmolLM2, 4096 tokens of pydoc_data.topics reach at most 1.35x the calibration text's
        amax in any layer. V needs the scale (layer 0's |v| <= 0.6 would sit in e4m3's
        subnormals with scale 1).
        """
        _, stored = self._prefill_forward(token_ids, self.dtype)
        layers = [layer.self_attn for layer in self.model.model.layers]
        for attn, (k, v) in zip(layers, stored, strict=True):
            k = k.float()
            attn.k_shift = k.mean(dim=0)
            # A layer that stored only zeros (or one constant) reads back exactly: keep 1.
            k_amax, v_amax = float((k - attn.k_shift).abs().amax()), float(v.abs().amax())
            attn.k_scale = 2 * k_amax / FP8_MAX if k_amax > 0 else 1.0
            attn.v_scale = 2 * v_amax / FP8_MAX if v_amax > 0 else 1.0
        k_scales = [attn.k_scale for attn in layers]
        v_scales = [attn.v_scale for attn in layers]
        logger.info(
            "fp8 KV scales from %d calibration tokens: k_scale %.3g..%.3g, v_scale %.3g..%.3g",
            len(token_ids),
            min(k_scales),
            max(k_scales),
            min(v_scales),
            max(v_scales),
        )

    @torch.inference_mode()
    def _profile_kv_cache_bytes(self) -> int:
        """Run the largest step (a max-size prefill, then logits and probabilities for
        `max_num_seqs` rows) on a scratch cache and leave its peak activation memory free:
        the KV pool gets `gpu_memory_utilization` of the device minus what is in use."""
        num_tokens = self.config.max_num_batched_tokens
        positions, common, _ = self._dummy_prefill(num_tokens, self.kv_cache_dtype)
        torch.cuda.reset_peak_memory_stats(self.device)
        with set_forward_context(self.attn_backend.build(common)):
            hidden_states = self.model(torch.zeros_like(positions), positions)
        num_rows = min(self.max_num_reqs, num_tokens)
        self.model.compute_logits(hidden_states[:num_rows]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        activation_bytes = torch.cuda.max_memory_allocated(self.device)
        del hidden_states
        torch.cuda.empty_cache()
        activation_bytes -= torch.cuda.memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        kv_bytes = int(total * self.config.gpu_memory_utilization) - (total - free)
        kv_bytes -= activation_bytes
        logger.info(
            "memory profile: %.2f GiB total, %.2f GiB in use, %.2f GiB peak activations, "
            "%.2f GiB for the KV cache (gpu_memory_utilization=%.2f)",
            total / 2**30,
            (total - free) / 2**30,
            activation_bytes / 2**30,
            kv_bytes / 2**30,
            self.config.gpu_memory_utilization,
        )
        if kv_bytes <= 0:
            raise ValueError(
                "no device memory left for the KV cache: raise gpu_memory_utilization or lower "
                "max_num_batched_tokens / max_num_seqs"
            )
        return kv_bytes

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV pool (per layer, K and V) and bind it to the model."""
        spec = self.kv_cache_spec
        self.kv_caches = spec.allocate(num_blocks, self.block_size, self.device)
        self.model.bind_kv_cache(self.kv_caches)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.initialize_kv_cache(num_blocks)
        num_bytes = num_blocks * spec.bytes_per_block(self.block_size)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s)",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            num_bytes / 2**20,
            spec.dtype,
        )
        if self.config.enforce_eager:
            return
        graphs_args = (self.max_num_blocks_per_req, self.block_size, self.device)
        sizes = capture_sizes(self.max_num_reqs)
        if self.device.type == "cuda" and self.attn_backend.name == "triton":
            if self.spec_config is not None:
                logger.info("speculative verify steps run without CUDA graphs (decode only)")
            self.decode_graphs = CudaDecodeGraphs(
                self.model, self.attn_backend, sizes, *graphs_args
            )
        elif self.attn_backend.name == "cpu":
            query_lens = (1,)
            if self.spec_config is not None:
                query_lens = (1, self.spec_config.num_speculative_tokens + 1)
            self.decode_graphs = CpuDecodeGraphs(
                self.model,
                self.attn_backend,
                sizes,
                *graphs_args,
                query_lens=query_lens,
                # Steps whose linear layers run on torch's matmul cannot be recorded.
                max_num_tokens=self.model.lm_head.method.cpu_graph_max_tokens,
                # Drafts only while fewer requests than the threshold run (`_propose`).
                max_verify_reqs=(
                    None if self.disable_by_batch_size is None else self.disable_by_batch_size - 1
                ),
            )
        if self.decode_graphs is not None:
            self.decode_graphs.capture()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor; on CUDA through pinned memory, without a host sync."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diffs to the runner's copy of each request."""
        for req_id in scheduler_output.preempted_req_ids:  # (some may have finished since)
            self._release_row(self.requests[req_id])
        self._forget(scheduler_output.finished_req_ids)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                row=self.free_rows.pop(),
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=params,
                generator=generator,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            )
            self.requests[new.req_id] = state
            if isinstance(self.proposer, DraftModelProposer):
                self.proposer.reset(new.req_id, new.num_computed_tokens)
            self.token_ids_cpu[state.row, : len(new.prompt_token_ids)] = new.prompt_token_ids
            self.block_table_cpu[state.row, : len(state.block_ids)] = state.block_ids
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.resumed_from_preemption[i]:
                state.row = self.free_rows.pop()
                self.token_ids_cpu[state.row, : state.num_tokens] = (
                    state.prompt_token_ids + state.output_token_ids
                )
                state.block_ids = list(cached.new_block_ids[i])
                if isinstance(self.proposer, DraftModelProposer):
                    self.proposer.reset(req_id, state.num_computed_tokens)
            else:
                state.block_ids.extend(cached.new_block_ids[i])
            self.block_table_cpu[state.row, : len(state.block_ids)] = state.block_ids
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            state = self.requests[req_id]
            start = state.num_tokens
            self.token_ids_cpu[state.row, start : start + len(drafts)] = drafts

    def _copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copies on write (`KVCacheManager.allocate_slots`): each destination block gets its
        source's K and V in every layer, the draft model's too, before the forward writes. The
        caches are copied as bytes, one way for every dtype (fp8 scales are per layer)."""
        if not blocks_to_copy:
            return
        src, dst = (
            self._to_device(np.array(ids, dtype=np.int64))
            for ids in zip(*blocks_to_copy, strict=True)
        )
        caches = list(self.kv_caches)
        if isinstance(self.proposer, DraftModelProposer):
            caches += self.proposer.kv_caches
        for cache in (c.view(torch.uint8) for layer in caches for c in layer):
            cache[dst] = cache[src]

    def _release_row(self, state: CachedRequestState) -> None:
        if state.row >= 0:
            self.free_rows.append(state.row)
            state.row = -1

    def _forget(self, req_ids: Iterable[str]) -> None:
        """Drop the runner's copy of these requests (those it holds) and free their rows."""
        for req_id in req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._release_row(state)
            if isinstance(self.proposer, DraftModelProposer):
                self.proposer.forget(req_id)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput, req_ids: list[str]):
        """The step's flat tensors, built with vectorised gathers on the persistent arrays."""
        states = [self.requests[r] for r in req_ids]
        num_scheduled = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64
        )
        input_ids, positions, common = self.build_batch(
            np.array([s.row for s in states], dtype=np.int64),
            np.array([s.num_computed_tokens for s in states], dtype=np.int64),
            num_scheduled,
        )
        seq_lens = common.seq_lens_cpu.numpy()
        cu_num_tokens = common.query_start_loc_cpu.numpy()[1:]
        # A request samples when this step reaches the end of its known tokens and drafts;
        # it takes logits of its last token and of each draft.
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = np.array([len(spec.get(r, ())) for r in req_ids], dtype=np.int64)
        is_sampling = seq_lens == np.array([s.num_tokens for s in states]) + num_drafts
        num_rows = num_drafts[is_sampling] + 1
        first_rows = np.repeat(cu_num_tokens[is_sampling] - num_rows, num_rows)
        logits_indices = (
            first_rows
            + np.arange(num_rows.sum())
            - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
        )
        return input_ids, positions, common, is_sampling, logits_indices

    def build_batch(
        self, rows: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
        """Input ids, positions and attention metadata of a flat batch: request i is the
        persistent row `rows[i]`, its tokens `num_computed[i]` .. + `num_scheduled[i]`."""
        cu_num_tokens = np.cumsum(num_scheduled)
        num_tokens = int(cu_num_tokens[-1])
        token_req_idx = np.repeat(np.arange(len(rows)), num_scheduled)
        offsets = np.arange(num_tokens) - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        positions = num_computed[token_req_idx] + offsets
        token_rows = rows[token_req_idx]
        input_ids = self.token_ids_cpu[token_rows, positions]
        block_numbers = self.block_table_cpu[token_rows, positions // self.block_size]
        slot_mapping = (
            block_numbers.astype(np.int64) * self.block_size + positions % self.block_size
        )
        seq_lens = (num_computed + num_scheduled).astype(np.int32)
        max_seq_len = int(seq_lens.max())
        query_start_loc = np.concatenate([[0], cu_num_tokens]).astype(np.int32)
        block_table = self.block_table_cpu[rows, : -(-max_seq_len // self.block_size)]
        to_device = self._to_device
        common = CommonAttentionMetadata(
            query_start_loc=to_device(query_start_loc),
            query_start_loc_cpu=torch.from_numpy(query_start_loc),
            seq_lens=to_device(seq_lens),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            block_table=to_device(block_table),
            slot_mapping=to_device(slot_mapping),
            num_reqs=len(rows),
            num_actual_tokens=num_tokens,
            max_query_len=int(num_scheduled.max()),
            block_size=self.block_size,
        )
        return to_device(input_ids), to_device(positions), common

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update request copies, forward the flat batch, sample.

        A step that raises changes nothing the next one relies on: the requests it added are
        forgotten (the scheduler sends them again as new, `Scheduler.undo_step`), those it
        resumes get their whole block table again, and per-request state that outlives a
        step (sampled tokens, generators, returned prompt logprobs) changes only once
        sampling has succeeded.
        """
        try:
            return self._execute_model(scheduler_output)
        except Exception:
            self._forget(new.req_id for new in scheduler_output.scheduled_new_reqs)
            raise

    @torch.inference_mode()
    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        self._copy_blocks(scheduler_output.blocks_to_copy)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [], [])
        input_ids, positions, common, is_sampling, logits_indices = self._prepare_inputs(
            scheduler_output, req_ids
        )
        if self.decode_graphs is not None and self.decode_graphs.can_run(common):
            hidden_states = self.decode_graphs.run(input_ids, positions, common)
        else:
            with set_forward_context(self.attn_backend.build(common)):
                hidden_states = self.model(input_ids, positions)
        completed = self._compute_prompt_logprobs(scheduler_output, req_ids, hidden_states)
        sampling_states = [self.requests[r] for r, s in zip(req_ids, is_sampling, strict=True) if s]
        sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[list[LogprobsEntry]] = [[] for _ in req_ids]
        spec_token_ids: list[list[int]] = []
        if sampling_states:
            logits = self.model.compute_logits(hidden_states[self._to_device(logits_indices)])
            spec = scheduler_output.scheduled_spec_decode_tokens
            drafts = [spec.get(s.req_id, []) for s in sampling_states]
            grammar = self._grammar_mask(scheduler_output, sampling_states, drafts)
            tokens, entries = self._sample(logits, sampling_states, drafts, grammar)
            sample_idx = np.flatnonzero(is_sampling)
            for j, state in enumerate(sampling_states):
                for token_id in tokens[j]:
                    state.output_token_ids.append(token_id)
                    if state.num_tokens <= self.max_model_len:
                        self.token_ids_cpu[state.row, state.num_tokens - 1] = token_id
                sampled_token_ids[sample_idx[j]] = tokens[j]
                logprobs[sample_idx[j]] = entries[j]
            if self.spec_config is not None:
                spec_token_ids = [[] for _ in req_ids]
                for j, drafts_j in enumerate(self._propose(sampling_states)):
                    spec_token_ids[sample_idx[j]] = drafts_j
        prompt_logprobs = {}
        for state in completed:
            prompt_logprobs[state.req_id], state.prompt_logprobs = state.prompt_logprobs, None
        return ModelRunnerOutput(
            req_ids, sampled_token_ids, logprobs, prompt_logprobs, spec_token_ids
        )

    def _grammar_mask(
        self,
        scheduler_output: SchedulerOutput,
        states: list[CachedRequestState],
        drafts: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`SamplingMetadata.grammar_mask`: the logits rows the scheduler's grammar bitmask
        masks (one per sampled position: s + 1 for a request with s drafts) and its rows there
        unpacked; None when no request sampling now has a grammar.

        numpy unpacks a row of 49,152 bits in 0.05 ms here, however few tokens it allows;
        xgrammar's CPU kernel, which writes each -inf on its own, took 0.27 ms on a row that
        allows few (most rows of a JSON text) and 16 such rows 4.3 ms, against 0.76 ms."""
        first_rows = scheduler_output.structured_output_request_ids
        if not first_rows:
            return None
        source: list[int] = []
        rows: list[int] = []
        row = 0
        for state, d in zip(states, drafts, strict=True):
            first = first_rows.get(state.req_id)
            if first is not None:
                source += range(first, first + len(d) + 1)
                rows += range(row, row + len(d) + 1)
            row += len(d) + 1
        # Bit t of int32 word w is token 32 w + t: little-endian bytes, bits unpacked in order.
        words = scheduler_output.grammar_bitmask[source].numpy()
        allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        allowed = self._to_device(allowed[:, : self.vocab_size]).view(torch.bool)
        return self._to_device(np.array(rows, dtype=np.int64)), allowed

    def _sample(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        drafts: list[list[int]],
        grammar_mask: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[list[list[int]], list[list[LogprobsEntry]]]:
        """Tokens and logprobs entries per sampling request, from its rows of `logits`: one
        row, or with drafts one row per draft and one more, verified (`rejection_sample`).
        Row j of a request with drafts is processed as if its first j drafts were output,
        its grammar too (`grammar_mask`, from `_grammar_mask`)."""
        row_states = [s for s, d in zip(states, drafts, strict=True) for _ in range(len(d) + 1)]
        row_outputs = [
            s.output_token_ids + d[:j] if j else s.output_token_ids
            for s, d in zip(states, drafts, strict=True)
            for j in range(len(d) + 1)
        ]
        has_drafts = any(drafts)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        metadata = SamplingMetadata.build(
            params=[s.sampling_params for s in row_states],
            prompt_token_ids=[s.prompt_token_ids for s in row_states],
            output_token_ids=row_outputs,
            # Rows are requests without drafts: the sampler draws with their generators.
            generators={} if has_drafts else generators,
            vocab_size=self.vocab_size,
            eos_token_ids=[self.eos_token_id] * len(row_states),
            device=self.device,
            grammar_mask=grammar_mask,
        )
        num_logprobs = [s.sampling_params.logprobs for s in states]
        if not has_drafts:
            out = self.sampler(logits, metadata)
            tokens = [[t] for t in out.sampled_token_ids.tolist()]
            if out.logprobs is None:
                return tokens, [[] for _ in states]
            entries = out.logprobs.to_entries(num_logprobs)
            return tokens, [[e] if e is not None else [] for e in entries]
        logits = apply_grammar_mask(logits, metadata)  # raw logprobs see it, as `Sampler`'s do
        processed = self.sampler.process_logits(logits, metadata)
        tokens = rejection_sample(
            drafts,
            target_argmax=argmax_rows(processed).tolist(),
            target_probs=None
            if metadata.all_greedy
            else self.sampler.compute_probs(processed, metadata),
            is_greedy=[s.sampling_params.is_greedy for s in states],
            generators=generators,
        )
        if metadata.max_num_logprobs is None:
            return tokens, [[] for _ in states]
        # Each emitted token's entry comes from its own row, from the raw distribution (as
        # `Sampler` reports them); a request's rows start where the previous one's end.
        rows, row_tokens, row_num_logprobs, row = [], [], [], 0
        for j, d in enumerate(drafts):
            rows += range(row, row + len(tokens[j]))
            row_tokens += tokens[j]
            row_num_logprobs += [num_logprobs[j]] * len(tokens[j])
            row += len(d) + 1
        raw_logprobs = torch.log_softmax(
            logits[self._to_device(np.array(rows))], dim=-1, dtype=torch.float32
        )
        top = gather_logprobs(
            raw_logprobs,
            metadata.max_num_logprobs,
            torch.tensor(row_tokens, dtype=torch.int64, device=self.device),
        )
        flat = top.to_entries(row_num_logprobs)
        entries, start = [], 0
        for j in range(len(states)):
            entries.append([] if num_logprobs[j] is None else flat[start : start + len(tokens[j])])
            start += len(tokens[j])
        return tokens, entries

    def _propose(self, states: list[CachedRequestState]) -> list[list[int]]:
        """Drafts for the next step of each request that sampled now; none at all when the
        step's batch reaches `disable_by_batch_size` (compute-bound: verification would cost
        more than it saves). Drafts are optional: a proposer that fails costs the step its
        drafts, never its tokens (they are already sampled)."""
        limit = self.disable_by_batch_size
        if limit is not None and len(self.requests) >= limit:
            return [[] for _ in states]
        try:
            if isinstance(self.proposer, NgramProposer):
                return [self.proposer.propose(self.token_ids_cpu[s.row, : s.num_tokens])
                        for s in states]  # fmt: skip
            return self.proposer.propose(states)
        except Exception:
            logger.exception("the %s proposer failed: no drafts this step", self.spec_config.method)
            return [[] for _ in states]

    def _compute_prompt_logprobs(
        self, scheduler_output: SchedulerOutput, req_ids: list[str], hidden_states: torch.Tensor
    ) -> list[CachedRequestState]:
        """Prompt logprobs from this step's rows, for the requests that ask for them.

        The row of prompt position p gives log P(prompt[p + 1] | prompt[:p + 1]). Entries
        accumulate in the request's state chunk by chunk; returns the requests whose prompt
        this step completes, whose entries the step returns ([P - 1] each). Rows recomputed
        after a preemption or a failed step are skipped: the entries computed before are kept.
        """
        if all(self.requests[r].prompt_logprobs is None for r in req_ids):
            return []
        rows: list[int] = []  # rows of `hidden_states` to take logits of
        target_ids: list[int] = []  # per row, the next prompt token
        num_logprobs: list[int] = []  # per row, its request's top-N
        segments: list[tuple[CachedRequestState, int]] = []  # (request, its number of rows)
        completed: list[CachedRequestState] = []
        row_start = 0
        for req_id in req_ids:
            state = self.requests[req_id]
            num_scheduled = scheduler_output.num_scheduled_tokens[req_id]
            if state.prompt_logprobs is not None:
                computed, num_prompt = state.num_computed_tokens, len(state.prompt_token_ids)
                first = max(computed, len(state.prompt_logprobs))
                last = min(computed + num_scheduled, num_prompt - 1)
                # No prefix-cache hits for these requests: their rows arrive in order.
                assert computed <= len(state.prompt_logprobs), (req_id, computed)
                if first < last:
                    rows.extend(range(row_start + first - computed, row_start + last - computed))
                    target_ids.extend(state.prompt_token_ids[first + 1 : last + 1])
                    num_logprobs += [state.sampling_params.prompt_logprobs] * (last - first)
                    segments.append((state, last - first))
                if computed + num_scheduled >= num_prompt:
                    completed.append(state)
            row_start += num_scheduled
        entries: list[LogprobsEntry] = []
        for i in range(0, len(rows), _PROMPT_LOGPROBS_ROWS):
            j = i + _PROMPT_LOGPROBS_ROWS
            hidden = hidden_states[self._to_device(np.array(rows[i:j]))]
            logprobs = torch.log_softmax(
                self.model.compute_logits(hidden), dim=-1, dtype=torch.float32
            )
            target = self._to_device(np.array(target_ids[i:j], dtype=np.int64))
            top = gather_logprobs(logprobs, max(num_logprobs[i:j]), target)
            entries += top.to_entries(num_logprobs[i:j])
            del logprobs  # peak memory: one slice's logits and logprobs
        start = 0
        for state, num_rows in segments:
            state.prompt_logprobs += entries[start : start + num_rows]
            start += num_rows
        return completed
