"""Shared by the Hugging Face capture tests: tiny models of several architectures built from configs (no downloads),
the models' own eager attention probabilities in float64, the KL between probability maps, one distillation step of
the engine, and flash-attention kernels for the CPU that transformers' own flash-attention path can call."""

from __future__ import annotations

import contextlib

import torch

from lightning_streamkl.engine import AttentionDistiller

F64 = torch.float64
VOCAB = 50


# ---------------------------------------------------------------------------------------------- probabilities
@contextlib.contextmanager
def float64_softmax():
    """transformers' eager attention calls ``softmax(..., dtype=torch.float32)`` even for float64 models; inside the
    block float64 inputs keep float64 (nothing else changes), so comparisons hold to float64 tolerance."""
    softmax = torch.nn.functional.softmax

    def softmax64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=torch.float64 if x.dtype == F64 else dtype)

    torch.nn.functional.softmax = softmax64
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax


def set_implementation(model, name: str) -> None:
    """Switch the attention implementation without transformers' availability check (so that the flash-attention
    names can run on the CPU kernels of :func:`cpu_flash`)."""
    model.config._attn_implementation = name


@contextlib.contextmanager
def implementation(model, name: str):
    previous = model.config._attn_implementation
    set_implementation(model, name)
    try:
        yield
    finally:
        set_implementation(model, previous)


def eager_outputs(model, **batch):
    """The model's output with ``output_attentions=True`` under eager attention, softmax in float64."""
    with implementation(model, "eager"), float64_softmax(), torch.no_grad():
        return model(**batch, output_attentions=True, use_cache=False)


def with_sink(p: torch.Tensor) -> torch.Tensor:
    """gpt-oss returns its probabilities without the sink's column; put it back (one more outcome per row)."""
    return torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1)


def kl_rows(p_t: torch.Tensor, p_s: torch.Tensor) -> torch.Tensor:
    """KL(P_t || P_s) per row from probability maps [B, H, N_q, N_k] (0·log 0 = 0)."""
    ratio = torch.where(p_t > 0, torch.log(p_t) - torch.log(p_s.clamp_min(1e-300)), torch.zeros_like(p_t))
    return (p_t * ratio).sum(-1)


def mean_kl(p_t: torch.Tensor, p_s: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of :func:`kl_rows` over the rows ``rows`` ([B, N_q] bool) keeps, every head."""
    kl = kl_rows(p_t, p_s)
    if rows is None:
        return kl.mean()
    return kl[rows[:, None, :].expand_as(kl)].mean()


# ---------------------------------------------------------------------------------------------- models
def _common(hidden: int, heads: int, kv_heads: int, layers: int) -> dict:
    return dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers,
                intermediate_size=2 * hidden, vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.2,
                pad_token_id=0)


def tiny(kind: str, *, seed: int, hidden: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2,
         impl: str = "sdpa", window: int = 4, dtype: torch.dtype = F64):
    """A tiny causal LM of architecture ``kind``: "llama", "mistral" (every layer a ``window``-token sliding window),
    "gemma2" (logit soft-cap 5 on every layer; sliding and global layers alternate), "gemma3" (one sliding, one
    global layer), "gpt_oss" (attention sinks, one sliding and one global layer; sinks drawn from N(0, 1))."""
    import transformers

    torch.manual_seed(seed)
    common = _common(hidden, heads, kv_heads, layers)
    head_dim = hidden // heads
    if kind == "llama":
        cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    elif kind == "mistral":
        cls, cfg = transformers.MistralForCausalLM, transformers.MistralConfig(sliding_window=window, **common)
    elif kind == "gemma2":
        cls = transformers.Gemma2ForCausalLM
        cfg = transformers.Gemma2Config(sliding_window=window, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=None, **common)
    elif kind == "gemma3":
        cls = transformers.Gemma3ForCausalLM
        cfg = transformers.Gemma3TextConfig(
            sliding_window=window, head_dim=head_dim, query_pre_attn_scalar=head_dim, final_logit_softcapping=None,
            layer_types=(["sliding_attention", "full_attention"] * layers)[:layers], **common)
    elif kind == "gpt_oss":
        cls = transformers.GptOssForCausalLM
        cfg = transformers.GptOssConfig(
            sliding_window=window, head_dim=head_dim, num_local_experts=2, num_experts_per_tok=1,
            experts_implementation="eager", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            layer_types=(["sliding_attention", "full_attention"] * layers)[:layers], **common)
    else:
        raise ValueError(f"unknown architecture {kind!r}")
    model = cls(cfg).to(dtype)
    set_implementation(model, impl)
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


def tiny_bart(*, seed: int, d_model: int = 32, impl: str = "sdpa", dtype: torch.dtype = F64):
    """A tiny encoder-decoder (one encoder layer, two decoder layers, 4 heads, no dropout)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BartConfig(
        vocab_size=VOCAB, d_model=d_model, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model, max_position_embeddings=64,
        init_std=0.2, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0)
    model = transformers.BartModel(cfg).to(dtype)
    set_implementation(model, impl)
    return model


def packed_row(lengths: list[int], seed: int = 0) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """One row of packed documents (``position_ids`` restart per document, no attention mask, as
    ``DataCollatorWithFlattening`` makes them), and the documents alone."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, VOCAB, (1, n), generator=g) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": torch.cat(docs, 1), "position_ids": positions}, docs


# ---------------------------------------------------------------------------------------------- one step
def distil(teacher, student, batch, pairs, *, student_batch=None, **config):
    """One engine step: the student's forward (``use_cache=False``) on ``student_batch`` (default ``batch``) inside
    the recording, then ``end_step``, which runs the teacher on ``batch`` and takes each pair's loss as its teacher
    layer records. Returns ``(LossOutput, teacher records, student records, output)``; the teacher's records come
    from a second pass of the teacher (the step's own are released as the loss is taken)."""
    distiller = AttentionDistiller(teacher, {"pairs": pairs, **config})
    distiller.setup(student)
    distiller.begin_step(batch)
    with distiller.student_recording():
        out = student(**(batch if student_batch is None else student_batch), use_cache=False)
    student_records = dict(distiller.student_capture.records)
    terms = distiller.end_step(batch)
    distiller.run_teacher(batch)
    teacher_records = dict(distiller.teacher_capture.records)
    distiller.clear()
    return terms, teacher_records, student_records, out


# ---------------------------------------------------------------------------------------------- flash on the CPU
def _attend(q, k, v, scale, causal, window, softcap, sink):
    """One sequence: ``q [N_q, H, D]``, ``k``/``v`` ``[N_k, H_k, D]``, flash-attn's masking (bottom-right causal,
    ``window=(left, right)``, −1 unbounded), soft-cap and sink, in float64."""
    n_q, heads, dim = q.shape
    n_k = k.shape[0]
    k, v = k.repeat_interleave(heads // k.shape[1], 1), v.repeat_interleave(heads // v.shape[1], 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * (scale if scale is not None else dim ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(n_q)[:, None] + (n_k - n_q), torch.arange(n_k)[None]
    left, right = window
    ok = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if causal or right >= 0:
        ok &= j <= i + (0 if causal else right)
    s = s.masked_fill(~ok, -torch.inf)
    if sink is not None:
        s = torch.cat([s, sink.double()[:, None, None].expand(heads, n_q, 1)], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)[..., :n_k]
    return torch.einsum("hqk,khd->qhd", p, v.double()).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False,
                           s_aux=None):
    """flash-attn's ``flash_attn_varlen_func`` on the CPU (with vLLM flash-attn 3's ``s_aux`` sinks)."""
    out = torch.zeros_like(q)
    for s in range(len(cu_seqlens_q) - 1):
        a, b, c, d = (int(x) for x in (cu_seqlens_q[s], cu_seqlens_q[s + 1], cu_seqlens_k[s], cu_seqlens_k[s + 1]))
        out[a:b] = _attend(q[a:b], k[c:d], v[c:d], softmax_scale, causal, window_size, softcap, s_aux)
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    deterministic=False, s_aux=None):
    """flash-attn's ``flash_attn_func`` (``[B, N, H, D]``) on the CPU."""
    return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal, window_size, softcap, s_aux)
                        for b in range(q.shape[0])])


@contextlib.contextmanager
def cpu_flash(name: str = "flash_attention_2"):
    """Make transformers' flash-attention path (``flash_attention_forward`` → ``_flash_attention_forward``: padding,
    ``cu_seq_lens``, ``position_ids``, ``sliding_window`` → ``window_size``, ``softcap``, ``s_aux``) run on the CPU
    kernels above: everything above the kernels is transformers' own code."""
    import transformers.modeling_flash_attention_utils as fa

    names = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn")
    kept = {n: getattr(fa, n) for n in names}
    fa._loaded_implementation = name
    fa._flash_fn, fa._flash_varlen_fn = flash_attn_func, flash_attn_varlen_func
    fa._pad_fn, fa._unpad_fn = fa._pad_input, fa._unpad_input
    fa._process_flash_kwargs_fn = fa._lazy_define_process_function(flash_attn_varlen_func)
    try:
        yield
    finally:
        for n, value in kept.items():
            setattr(fa, n, value)
