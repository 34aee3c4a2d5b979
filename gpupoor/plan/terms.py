"""The memory terms of one training step, each arithmetic over the model's shape and the resolved recipe: the
base weights, the optimizer state, what autograd keeps for the backward pass (the activations), the loss's
working set, a distillation teacher's or DPO reference's weights, and what the C heap keeps.

The activation term counts what autograd keeps for the backward pass of one decoder layer of transformers'
Llama-family code (the tensors saved by each op, per token, by dtype) for each peft.method, in the layers that
need a gradient (none below the first trained one) -- tests compare it with what autograd really saves. What
no formula gives is a measured constant, named below with how it was measured (the process's own baseline and
the CUDA allocator's slack: gpupoor.plan.peak).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from gpupoor.decisions import loss_chunk_tokens
from gpupoor.optimizers import state_per_parameter
from gpupoor.method_table import METHODS
from gpupoor.plan.settings import Settings, what_trains
from gpupoor.model.shape import LINEARS, NORMS, Shape, TokenizerSize
from gpupoor.plan.training import LayerTraining
from gpupoor.units import MiB, format_bytes

# glibc keeps some freed tensors in its heap, so on the CPU the resident peak exceeds the live tensors. It keeps
# more the more layers a step runs through: each layer's forward and backward leave a few holes between the
# tensors that outlive them (measured: 30 layers of SmolLM2-135M kept 170-490 MiB, 12 layers of the same width
# 30-130 MiB, a 4-layer model a few tens). Only blocks under glibc's mmap threshold land in the heap at all: the
# threshold rises to the largest block freed but never above 32 MiB on 64-bit, and a larger block is unmapped
# when freed. So: retained MiB = base + slope x (layers that keep activations) x (one layer's forward and
# saved allocations in tensors under 32 MiB, MiB), least squares per mode over 21 calibration recipes that are in
# no accuracy table: random-weight models of 24 x 384, 12 x 576 and 16 x 768 with the real model's tokenizer and
# the real demo's data (5 recipes each), and the six 4-layer fixture recipes (`python bench/plan_accuracy.py
# --calibrate-retention`, docs/benchmarks.md). Runs vary by about 5-10% of the peak around it.
CPU_HEAP_RETENTION = {"checkpointing": (2, 0.0436), "none": (-45, 0.0407)}
GLIBC_MMAP_THRESHOLD_MAX = 32 * MiB
# A quantized base on the CPU: bitsandbytes dequantizes each weight for its matmul (forward, recomputation and
# backward), and the heap keeps more of that churn within a step: this many times one layer's linear weights in
# the compute dtype. Fitted like the constant above, on three 4-bit calibration recipes (h512 and h1024, with and
# without checkpointing): 4.29, 2.65 and 3.89, the mean taken.
CPU_DEQUANTIZED_RETENTION = 3.6
# The fused loss: a chunk of logits (gpupoor.decisions.loss_chunk_tokens) in fp32, with their exponentials and
# gradient alive together.
FUSED_CHUNK_COPIES = 3
# The fused distillation loss (gpupoor.objectives.distill): per chunk the student's logits, the teacher's, the scaled
# difference and logsumexp's temporaries, chunk x vocabulary in fp32 each. Measured on the CPU (glibc's in-use
# bytes after each op, linear_distill_sum at vocabulary 32,000): 5.0 buffers in fp32; 6.0 with bf16 heads, which
# a CPU casts slice by slice into one more (the fused cross-entropy alone: 2.0 and 2.5, planned as 3).
DISTILL_CHUNK_COPIES = 5
# The teacher's forward under no_grad keeps nothing, but one layer's working set is alive at a time: measured
# the same way on 2-layer Llamas (hidden 256/512, intermediate 704/1376, fp32 and bf16), 4 x hidden + 3 x
# intermediate values per token within 1% (3.1 x intermediate: just above).
TEACHER_FORWARD_VALUES = (4, 3.1)  # per token: (x hidden, x intermediate)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# What a loaded tokenizer keeps resident on the CPU, in bytes (per id, per BPE merge), by how transformers builds
# it (gpupoor.model.shape.TokenizerSize.rebuilt): a class of its own (GemmaTokenizer, Qwen2Tokenizer ...) rebuilds
# it from Python copies of the vocabulary and merges and keeps them; TokenizersBackend hands tokenizer.json to
# the `tokenizers` library as it is. Least squares over the resident size a tokenizer adds after gc and
# malloc_trim in a process that imported torch and transformers, for synthetic byte-level (49k and 152k ids, a
# merge each) and SentencePiece-style tokenizers (66k, 131k and 262k ids, ~1.9 merges each: Gemma 3's has 262,144
# ids and 514,906 merges) loaded both ways, and SmolLM2's (49,152 ids): each within 3 MiB of the fit
# (`python bench/plan_accuracy.py --calibrate-tokenizers`, docs/benchmarks.md). Gemma 3's: 266 MiB. The process
# baseline (gpupoor.plan.peak) was measured with the test fixture's tokenizer (a few thousand ids: under 2 MiB).
TOKENIZER_BYTES = {True: (204, 438), False: (246, 105)}  # rebuilt -> (per id, per merge)


def input_groups(shape: Shape) -> tuple[tuple[tuple[str, ...], str | None], ...]:
    """The inputs of a layer's linears: consumers of one tensor (the attention norm's output, the MLP norm's, the
    MLP product), which in fp32 keep it once between them. o_proj's input is the attention output, counted apart."""
    return ((("q_proj", "k_proj", "v_proj"), "input_layernorm"),
            (("gate_proj", "up_proj"), shape.mlp_input_norm),
            (("down_proj",), None))


def norms_saved_per_token(shape: Shape, s: Settings) -> float:
    """What a layer's RMSNorms keep for backward, per token: each its input and 1/rms per row. Under autocast the
    input kept is the fp32 copy the norm computes in (Llama's, Qwen's and Gemma's norms all upcast)."""
    width = 4 if s.half else s.act_bytes
    return sum(shape.norm_width(name) * width + shape.norm_rows(name) * 4 for name in shape.norms)


def tokenizer_bytes(shape: Shape) -> tuple[int, str]:
    """What the tokenizer keeps resident (TOKENIZER_BYTES). One whose files are not at hand is taken as the model's
    vocabulary with a merge per id, rebuilt (the model type's own class)."""
    size = shape.tokenizer or TokenizerSize(shape.vocab, shape.vocab, rebuilt=True)
    per_id, per_merge = TOKENIZER_BYTES[size.rebuilt]
    how = "rebuilt by transformers" if size.rebuilt else "read as it is"
    return (size.rows * per_id + size.merges * per_merge,
            f"{size.rows:,} ids and {size.merges:,} merges, {how}" + ("" if shape.tokenizer else " (assumed)"))


def weight_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    dtype = DTYPE_BYTES[s.precision]
    training = what_trains(shape, s)
    linear = shape.layers * shape.layer_linear_params
    rest = shape.total_params - linear
    note = ""
    # (A tied head reads every row in the loss; a trained copy materializes them all. A quantized load on the
    # CPU keeps the embedding a view of the file like an unquantized one: measured.)
    if s.resident_embedding_rows is not None and s.resident_embedding_rows < shape.vocab \
            and not shape.tied and not training.embedding:
        unread = (shape.vocab - s.resident_embedding_rows) * shape.hidden
        rest -= unread
        note = f" ({unread / 1e6:,.1f}M embedding rows the tokenizer never produces stay unread on disk)"
    if not METHODS[training.method].adapter:
        # The trained tensors are fp32 master weights (the trainable term); the frozen rest stays in the run's dtype.
        frozen = linear + rest - training.params
        return frozen * dtype, (f"{frozen / 1e6:,.1f}M frozen parameters in {s.precision}{note}; the "
                                f"{training.params / 1e6:,.1f}M that train are the trainable term")
    # A quantized base whose other tensors are views of the mapped file: the pages its linears were read from.
    source = linear * dtype if s.bits and s.weights_mapped else 0
    source_note = f"; the file's pages they were quantized from {source / MiB:.0f} MiB (still mapped)" if source else ""
    if s.bits == 4:
        # NF4/FP4: half a byte per weight + an absmax per 64 weights (fp32; or 8-bit with one fp32 per 256
        # absmax when double-quantized).
        constants = linear / 64 * (1 + 4 / 256) if s.double_quant else linear / 64 * 4
        total = linear / 2 + constants + rest * dtype + source
        return int(total), (f"{linear / 1e6:,.0f}M linear weights in 4-bit + constants "
                            f"{constants / MiB:.0f} MiB{source_note}; {rest / 1e6:,.0f}M others in "
                            f"{s.precision}{note}")
    if s.bits == 8:
        rows = shape.layers * sum(out for _, out in map(shape.linear, LINEARS))
        total = linear + rows * 4 + rest * dtype + source  # int8 + one fp32 scale per output row
        return int(total), (f"{linear / 1e6:,.0f}M linear weights in int8{source_note}; {rest / 1e6:,.0f}M others "
                            f"in {s.precision}{note}")
    return (linear + rest) * dtype, f"{shape.total_params / 1e6:,.1f}M parameters in {s.precision}{note}"


def trainable_params(shape: Shape, s: Settings) -> int:
    return what_trains(shape, s).params


def optimizer_bytes(params: int, s: Settings) -> tuple[int, str]:
    per_param, what = state_per_parameter(s.optimizer, s.momentum)
    return int(params * per_param), what


def layer_saved_bytes_per_token(shape: Shape, s: Settings, row_tokens: int, *, masked: bool,
                                layer: LayerTraining | None = None) -> float:
    """Bytes autograd keeps for the backward pass of one decoder layer, per token of the micro-batch, for a
    layer that trains `layer` (default: the last layer, which every method trains) with gradients flowing in.

    Counted from transformers' Llama-family layer (tests check it against saved-tensor hooks for each method, and
    on Gemma 3's layer): each RMSNorm keeps its input and 1/rms (a trained norm weight also its normalized input;
    two norms a layer, four in Gemma 2 and 3, and q_norm and k_norm over every query and key head in Qwen3 and
    Gemma 3), attention keeps rotated q, k, v, the output and the log-sum-exp (flash/SDPA) or the probabilities
    (eager), the gated MLP
    keeps gate, up and act(gate). A linear keeps its input when its weight trains or it carries a LoRA/DoRA
    adapter (which also keeps its rank-r projection; DoRA also the base and LoRA outputs for the magnitude's
    gradient); IA3 keeps the unscaled output of an output-scaled module, the input of an input-scaled one.
    """
    q, kv, heads = shape.q, shape.kv, shape.heads
    half, b = s.half, s.act_bytes
    method = s.method
    layer = layer if layer is not None else what_trains(shape, s).layers[-1]
    kind = METHODS[method]
    lora = tuple(n for n in layer.adapters if n in LINEARS) if kind.low_rank else ()
    feedforward = tuple(n for n in layer.adapters if n in s.training.feedforward) if kind.scaling_vector else ()
    out_scaled = tuple(n for n in layer.adapters if n not in feedforward) if kind.scaling_vector else ()
    lora_inputs = {name: shape.linear(name)[0] for name in lora}
    total = norms_saved_per_token(shape, s)
    if half and not s.fused_mlp:
        # peft casts each LoRA input to the adapter's fp32 and autocast casts it back: every adapted module keeps
        # its own half-precision copy. (The fused functions compute in the base's half dtype: the fp32 count.)
        total += sum(lora_inputs.values()) * b
        for members, norm in input_groups(shape):
            size = shape.linear(members[0])[0]
            trained = [n for n in members if n in layer.weights]
            # autocast casts a trained weight's input to half: an fp32 input (a norm's output when its fp32
            # weight trains, or an fp32 residual stream) into a copy per linear, a half one not at all (kept once).
            wide = norm is not None and (norm in layer.norms or s.residual_bytes == 4)
            total += (len(trained) if wide else min(len(trained), 1)) * size * b
            if any(n in feedforward for n in members):  # IA3 scales it in its vector's fp32
                total += size * 4
    else:
        if s.dropout:  # each adapter keeps its own dropped input instead of the shared one
            total += sum(lora_inputs.values()) * b
        for members, _ in input_groups(shape):
            users = [n for n in members if (n in lora and not s.dropout) or n in layer.weights or n in feedforward]
            if s.fused_mlp and "gate_proj" in members:
                users = members  # the fused MLP keeps its input for backward, adapters or not
            elif s.fused_mlp and "down_proj" in members:
                users = []  # ... and recomputes the product down_proj reads
            total += min(len(users), 1) * shape.linear(members[0])[0] * b
    # a trained norm weight's gradient needs its normalized input
    total += sum(map(shape.norm_width, layer.norms)) * s.residual_bytes
    if s.dropout:  # the dropout mask: bool on CUDA, the scaled noise in the input's dtype on the CPU
        total += sum(lora_inputs.values()) * (1 if s.device == "cuda" else (4 if not half else b))
    total += len(lora_inputs) * s.rank * b  # x @ A, kept for the gradient of B
    if kind.magnitude:  # the base and LoRA outputs, for the magnitude's gradient
        total += 2 * sum(shape.linear(name)[1] for name in lora) * b
    total += sum(shape.linear(name)[1] for name in out_scaled) * b  # IA3: the unscaled output, for the scale's gradient
    if s.attention_per_example:
        # gpupoor.model.packed_attention keeps rotated q, k and v. On the CPU it keeps its output and log-sum-exp
        # too; the output is o_proj's input, one copy for both. Elsewhere it recomputes the attention in backward
        # and leaves the output to o_proj, which keeps it where its own backward needs it (an adapted or trained
        # o_proj; under autocast an adapter keeps its own cast copy, counted with the adapters' inputs).
        cpu = s.device == "cpu"
        plain_lora = not half or s.fused_mlp  # o_proj's adapter keeps the output itself, not its own cast copy
        keeps_output = cpu or "o_proj" in layer.weights or (plain_lora and (("o_proj" in lora and not s.dropout)
                                                                            or "o_proj" in feedforward))
        total += ((2 if keeps_output else 1) * q + 2 * kv) * b + (heads * 4 if cpu else 0)
        return total + _mlp_saved(shape, s)
    # attention: rotated q, k and v, and the output (kept by SDPA/flash for its backward; o_proj's input)
    total += (2 * q + 2 * kv) * b
    if s.attention == "eager":
        total += heads * row_tokens * (b + (4 if half else 0))  # the probabilities (fp32 softmax, then cast)
        total += 2 * (q - kv) * b  # k and v repeated to every query head
    else:
        total += heads * 4  # log-sum-exp per head
    if masked and s.attention != "flash_attention_2":
        total += row_tokens * (4 if s.device == "cpu" else b)  # the mask as an additive float bias, per layer
    return total + _mlp_saved(shape, s)


def _mlp_saved(shape: Shape, s: Settings) -> float:
    """The gated MLP's own: gate, up and act(gate); the fused MLP recomputes act(gate)."""
    return (2 if s.fused_mlp else 3) * shape.intermediate * s.act_bytes


def layer_transient_bytes_per_token(shape: Shape, s: Settings) -> float:
    """What one layer's backward allocates beyond the saved tensors: the gradients flowing through it (the
    residual stream, the MLP's intermediate products) before they are freed."""
    return (2 * shape.hidden + 3 * shape.intermediate) * s.act_bytes


def layer_forward_temporaries_per_token(shape: Shape, s: Settings) -> float:
    """Bytes one layer's forward allocates and frees again (projections before rotation and before the
    LoRA sum, norm intermediates ...): counted with a dispatch-mode tally of every op output of transformers'
    Llama layer with LoRA on every linear, minus what autograd keeps. A norm beyond Llama's two (Gemma's sandwich
    norms, q_norm and k_norm) adds its square and its normalized input per value and two steps of 1/rms per row
    (tallied the same way on Gemma 3's layer: within 3% of the sum)."""
    llama = 9.75 * (shape.hidden + shape.q) + 10.5 * shape.kv + 6 * shape.intermediate
    extra_norms = sum(2 * (shape.norm_width(name) + shape.norm_rows(name))
                      for name in shape.norms if name not in NORMS)
    return (llama + extra_norms) * s.act_bytes


def dora_weight_norm_bytes(shape: Shape, s: Settings, targets: tuple[str, ...]) -> int:
    """What DoRA's forward allocates for one adapted module at a time to take the norm of W + s*B@A (peft
    builds B@A as lora_B(lora_A(eye(in)))): measured on the CPU (glibc's in-use bytes after each op, one
    module's forward) as the identity in fp32 plus three weight-sized fp32 matrices in fp32; under bf16
    autocast the larger of the identity with its half copy + one half matrix, and a half identity + 16 bytes
    per weight (fp32 copies for the norm). The largest adapted module counts."""
    sizes = [shape.linear(name) for name in targets]
    if not s.half:
        return max((4 * a * a + 12 * a * o for a, o in sizes), default=0)
    return max((max(6 * a * a + 2 * a * o, 2 * a * a + 16 * a * o) for a, o in sizes), default=0)


def saved_activation_bytes(shape: Shape, s: Settings, masked: bool) -> tuple[float, float, int, int]:
    """(what the decoder keeps for backward, the most one layer keeps, layers that keep any, the frozen layers
    below them that keep none), without checkpointing, for one micro-batch.

    Each layer from the first that trains (or from the first, when the embedding trains) keeps what
    `layer_saved_bytes_per_token` counts. The first of them keeps no input norm when its input needs no
    gradient, and the final norm keeps as much: they cancel, unless the embedding trains (then the final
    norm's input and 1/rms are on top), and a trained final norm weight also keeps its normalized input."""
    tokens = s.micro_batch * s.row_tokens
    training = what_trains(shape, s)
    first = training.first_active_layer
    active = Counter(training.layers[first:])
    per_layer = {layer: layer_saved_bytes_per_token(shape, s, s.row_tokens, masked=masked, layer=layer) * tokens
                 for layer in active}
    saved = sum(per_layer[layer] * count for layer, count in active.items())
    if active:
        norm_input = (4 * shape.hidden + 4) if s.half else (shape.hidden * s.act_bytes + 4)  # fp32 copy, 1/rms
        saved += ((norm_input if training.embedding else 0)
                  + (shape.hidden * s.residual_bytes if training.final_norm else 0)) * tokens
    return saved, max(per_layer.values(), default=0.0), len(training.layers) - first, first


def activation_bytes(shape: Shape, s: Settings) -> tuple[int, int, str]:
    """(live bytes at the peak, bytes the step allocates and frees on the way, description)."""
    tokens = s.micro_batch * s.row_tokens
    training = what_trains(shape, s)
    # Packed rows carry a block-diagonal mask. A random batch may pad a short example to a long one: a padding
    # mask. Length-grouped batches put the longest examples together: the longest batch has no padding.
    # flash-attn 2 needs neither.
    masked = s.attention != "flash_attention_2" and not s.packed_attention and (
        s.sampler == "packed" or (s.sampler == "random" and s.micro_batch > 1))
    saved, per_layer, active, frozen = saved_activation_bytes(shape, s, masked)
    # Layers below the first trained one get no gradient: backward never reaches them, they keep nothing.
    transient = layer_transient_bytes_per_token(shape, s) * tokens if active else 0
    if s.checkpointing:
        kept = shape.hidden * s.residual_bytes * tokens  # each checkpointed layer keeps only its input
        on_device = 0 if (s.checkpointing == "offload" and s.device == "cuda") else active * kept
        live = on_device + per_layer + transient  # plus one layer recomputed during its backward
        mode = "checkpointing: layer inputs offloaded to CPU" if not on_device and active else "checkpointing"
        detail = (f"{mode}: {active} x {kept / MiB:.1f} MiB layer inputs + one layer recomputed "
                  f"{per_layer / MiB:.1f} MiB")
    else:
        live = saved + transient
        detail = f"{active} layers x {per_layer / MiB:.1f} MiB kept for backward"
    if frozen:
        detail += f" ({frozen} frozen layers below keep none)"
    layer_for_churn = per_layer or layer_saved_bytes_per_token(shape, s, s.row_tokens, masked=masked) * tokens
    churn = layer_for_churn + layer_forward_temporaries_per_token(shape, s) * tokens
    if s.bits is not None:  # bitsandbytes dequantizes each weight for its matmul: buffers of a weight's size
        live += 2 * max(x * y for x, y in map(shape.linear, LINEARS)) * s.act_bytes
        churn += shape.layer_linear_params * s.act_bytes
    if s.half and s.distribution.strategy != "fsdp":  # FSDP gathers them already in half: nothing to cast
        # autocast caches a half copy of every fp32 weight that trains (full, modules_to_save) for the whole
        # forward and loss; backward keeps each until its layer is done.
        copies = 2 * (sum(shape.linear_params(name) for layer in training.layers for name in layer.weights)
                      + (shape.embedding_params if training.head else 0))
        if copies:
            live += copies
            detail += f"; half copies of the trained fp32 weights (autocast) {copies / MiB:.1f} MiB"
    if METHODS[training.method].magnitude and active:
        norm = dora_weight_norm_bytes(shape, s, training.layers[-1].adapters)
        live += norm
        detail += f"; DoRA weight norm {norm / MiB:.1f} MiB"
    detail += f"; {s.micro_batch} x {s.row_tokens} tokens, {s.attention}" + (" + mask" if masked else "")
    return int(live), int(churn), detail


def teacher_weight_bytes(teacher: Shape, s: Settings) -> tuple[int, str]:
    """The frozen teacher's weights: in the run's dtype, or quantized (distill.bits) like a quantized base."""
    frozen = Settings(device=s.device, precision=s.precision, attention=s.attention, sampler=s.sampler,
                      micro_batch=s.micro_batch, row_tokens=s.row_tokens, rank=0, targets=(), modules_to_save=(),
                      dropout=0.0, bits=s.teacher_bits, double_quant=s.double_quant, optimizer=s.optimizer, momentum=0.0,
                      checkpointing=False, fused_loss=s.fused_loss)
    weights, detail = weight_bytes(teacher, frozen)
    return weights, f"teacher {detail}"


def reference_weight_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    """DPO's frozen reference copy (preference.reference: copy): the base once more, in the run's dtype or quantized
    with preference.reference_bits. (Its forward runs before the policy's, under no_grad: its working set is gone
    before the peak, and it keeps only each sequence's log-probability.)"""
    weights, detail = teacher_weight_bytes(shape, replace(s, teacher_bits=s.reference_bits))
    return weights, "DPO reference copy " + detail.removeprefix("teacher ")


def teacher_forward_bytes(teacher: Shape, s: Settings) -> int:
    """What the teacher's no-grad forward holds at once beside the student's activations (it runs after the
    student's forward): one layer's working set (TEACHER_FORWARD_VALUES), and with a quantized teacher the
    dequantized weight buffers."""
    tokens = s.micro_batch * s.row_tokens
    per_hidden, per_intermediate = TEACHER_FORWARD_VALUES
    working = int((per_hidden * teacher.hidden + per_intermediate * teacher.intermediate) * s.act_bytes * tokens)
    if s.teacher_bits is not None:
        working += 2 * max(x * y for x, y in map(teacher.linear, LINEARS)) * s.act_bytes
    return working


def loss_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    tokens = s.micro_batch * s.row_tokens
    teacher = s.teacher
    if s.fused_loss:
        vocab = max(shape.vocab, teacher.vocab) if teacher else shape.vocab
        chunk_tokens = loss_chunk_tokens(vocab)
        copies = FUSED_CHUNK_COPIES
        if teacher:
            copies = DISTILL_CHUNK_COPIES + (1 if s.half and s.device == "cpu" else 0)
        chunk = min(chunk_tokens, tokens) * vocab * 4
        hidden = tokens * shape.hidden * 4 * 2  # targets' hidden states and their gradient
        if what_trains(shape, s).head:
            hidden += shape.embedding_params * 4  # the trained head's fp32 gradient, built during the forward
        detail = f"chunked: {min(chunk_tokens, tokens)} tokens x {vocab:,} vocab at a time"
        if not teacher:
            return copies * chunk + hidden, detail
        # The teacher's last hidden states (every position, then the target ones), and the larger of its forward
        # working set and the fused KL's chunk buffers (one after the other).
        teacher_hidden = 2 * tokens * teacher.hidden * s.act_bytes
        forward = teacher_forward_bytes(teacher, s)
        return (hidden + teacher_hidden + max(copies * chunk, forward),
                f"fused distillation (KL + cross-entropy) {detail}, {copies} buffers; teacher hidden states "
                f"{teacher_hidden / MiB:.1f} MiB; teacher forward {forward / MiB:.1f} MiB")
    b = DTYPE_BYTES[s.precision]
    logits = tokens * shape.vocab
    # the logits, their fp32 copy (a no-op in fp32), log-softmax kept for backward, and its gradient
    total = logits * b + logits * 4 * (2 if b == 4 else 3)
    if not teacher:
        return total, f"full logits: {tokens:,} tokens x {shape.vocab:,} vocab, fp32 log-softmax and gradient"
    # plain distillation: the teacher's logits (and their fp32 copy), both models' scaled log-softmax and the
    # KL's elementwise terms, at the teacher's vocabulary; after the teacher's forward has freed its working set
    teacher_logits = tokens * teacher.vocab
    total += teacher_logits * (b + 4 * (3 if b == 4 else 4))
    return (max(total, logits * b + teacher_forward_bytes(teacher, s)),
            f"full logits of student and teacher: {tokens:,} tokens x {shape.vocab:,} vocab, fp32 log-softmax, "
            "KL and gradient")


def heap_served_bytes(shape: Shape, s: Settings, layer_allocations: int) -> int:
    """The part of one layer's allocations (`activation_bytes`' churn) in blocks glibc serves from its heap (under
    GLIBC_MMAP_THRESHOLD_MAX): the MLP's intermediate-width tensors (3 kept, 6 temporaries per token) and the
    rest (hidden-, query- and key-width, the mask) each go by the size of their largest tensor."""
    tokens = s.micro_batch * s.row_tokens
    wide = 9 * shape.intermediate * s.act_bytes * tokens
    narrow = layer_allocations - wide
    served = narrow if tokens * max(shape.hidden, shape.q) * s.act_bytes <= GLIBC_MMAP_THRESHOLD_MAX else 0
    return served + (wide if tokens * shape.intermediate * s.act_bytes <= GLIBC_MMAP_THRESHOLD_MAX else 0)


def layers_keeping_activations(shape: Shape, s: Settings) -> int:
    """The layers a step's backward runs through: from the first that trains (none below it keeps anything)."""
    training = what_trains(shape, s)
    return len(training.layers) - training.first_active_layer


def heap_retention(shape: Shape, s: Settings, layer_allocations: int, dequantized_layer: int = 0) -> int:
    """Bytes of freed step memory the C heap keeps (CPU): from the layers that keep activations and one layer's
    allocations that the heap serves, and, with a quantized base, one layer's weights as bitsandbytes dequantizes
    them for each matmul."""
    base_mib, slope = CPU_HEAP_RETENTION["checkpointing" if s.checkpointing else "none"]
    served = heap_served_bytes(shape, s, layer_allocations)
    return max(0, int(base_mib * MiB + slope * layers_keeping_activations(shape, s) * served + CPU_DEQUANTIZED_RETENTION * dequantized_layer))


def generation_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    """GRPO's sampling, before the update: the KV cache of every answer of a micro-batch (keys and values of each
    layer, in the weights' dtype, for its prompt and answer) and each new token's logits with top-p's sorted copy;
    all freed before the update's forward."""
    cache = 2 * shape.layers * shape.kv_heads * shape.head_dim * s.sampled_answers * s.row_tokens * s.act_bytes
    logits = s.sampled_answers * shape.vocab * 4 * 4  # fp32 logits, their softmax, the sorted values and order
    return cache + logits, (f"KV cache of {s.sampled_answers} answers x {s.row_tokens} tokens "
                            f"{format_bytes(cache)}, the last token's logits {format_bytes(logits)}")


def grpo_update_bytes(shape: Shape, s: Settings) -> tuple[int, int, str, int, str]:
    """GRPO's update: (live, churn, detail) of its activations and (bytes, detail) of its log-probabilities. Each
    prompt read once for its group (`shared_prompts`): the prompts' layers (prompt_rows x prompt_tokens) and the
    answers' (sampled_answers x new_tokens), and the prompts' keys and values repeated for every answer, which
    the answers' attention keeps for backward; else every answer's row whole. The log-probabilities are of the
    answer tokens only."""
    answers = replace(s, micro_batch=s.sampled_answers, row_tokens=s.new_tokens)
    loss, loss_detail = loss_bytes(shape, answers)
    if not s.shared_prompts:
        live, churn, detail = activation_bytes(shape, s)
        return live, churn, detail + " (each prompt with every answer)", loss, loss_detail
    prompts = replace(s, micro_batch=s.prompt_rows, row_tokens=s.prompt_tokens)
    prompt_live, prompt_churn, _ = activation_bytes(shape, prompts)
    answer_live, answer_churn, _ = activation_bytes(shape, answers)
    cache = 2 * shape.layers * shape.kv_heads * shape.head_dim * s.sampled_answers * s.prompt_tokens * s.act_bytes
    detail = (f"prompts {prompt_live / MiB:.1f} MiB ({s.prompt_rows} x {s.prompt_tokens} tokens, each read once "
              f"for its group) + answers {answer_live / MiB:.1f} MiB ({s.sampled_answers} x {s.new_tokens} "
              f"tokens) + the prompts' keys and values for every answer {cache / MiB:.1f} MiB")
    return prompt_live + answer_live + cache, max(prompt_churn, answer_churn), detail, loss, loss_detail
