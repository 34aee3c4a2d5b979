"""build_data: the recipe's data section -> tokenized train/eval sets and a batch plan; collate to tensors."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gpupoor.data.dataset import TokenizedDataset, TokenStats, cache_key, concat_datasets, data_identity
from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.data.encoder import Encoder
from gpupoor.data.row_formats import FieldNames, sequences_per_example
from gpupoor.data.loading import DataSource, check_held_out, resolve_source
from gpupoor.data.mixture import Mixture, Source, source_counts
from gpupoor.data.sampler import BatchPlan, first_fit_decreasing
from gpupoor.data.tokenize import load_tokenized_dir, manifest_mixture, manifest_source_stats, tokenize_source
from gpupoor.errors import UserError
from gpupoor.storage.files import default_cache_dir
from gpupoor.recipe.rules import check_rows, check_tokenized_settings
from gpupoor.recipe.schema import DataSection, SourceSection


@dataclass
class DataBundle:
    train: TokenizedDataset  # every source's examples end to end
    eval: TokenizedDataset | None
    plan: BatchPlan
    cache_hit: bool
    fingerprint: str  # identity of the tokenized training data (data bytes, tokenizer, format settings, mixture)
    warnings: list[str] = field(default_factory=list)  # e.g. a cache entry that failed its check
    mixture: Mixture | None = None  # the sources, their amounts per epoch, their eval ranges
    source_stats: list[TokenStats] = field(default_factory=list)  # per source, in mixture order
    pairs: bool = False  # examples are preference pairs (data.format: preference): collated by collate_pairs

    def collate(self, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        """A training micro-batch: packed into rows when the sampler packs, else padded."""
        packed = self.plan.kind == "packed"
        if self.pairs:
            return collate_pairs(self.train, indices, pad_id, self.plan.row_length if packed else None)
        if packed:
            return collate_packed(self.train, indices, self.plan.row_length, pad_id)
        return collate(self.train, indices, pad_id)

    def collate_eval(self, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        """An eval micro-batch, padded."""
        assert self.eval is not None
        return collate_pairs(self.eval, indices, pad_id) if self.pairs else collate(self.eval, indices, pad_id)

    def eval_groups(self) -> list[tuple[str, int, int]]:
        """(source name, start, end) of each source's eval examples; one group when there is no mixture."""
        if self.eval is None:
            return []
        if self.mixture is None or len(self.mixture.sources) == 1:
            return [("all", 0, len(self.eval))]
        return [(s.name, s.eval_start, s.eval_end) for s in self.mixture.sources if s.eval_end > s.eval_start]


def make_encoder(data: DataSection, tokenizer, source: SourceSection | None = None) -> Encoder:
    """The encoder of one source (its format and field names), or of the data section's own settings."""
    source = source or (data.sources() or [None])[0]
    fields = source if source is not None else data
    return Encoder(tokenizer, fields.format, data.max_length, data.train_on_prompt, chat_template=data.chat_template,
                   **asdict(FieldNames.of(fields, data.sharegpt_roles)))


def _tokenized(source: DataSource, limit: int | None, encoder: Encoder, tokenizer,
               cache_dir: Path | None, warnings: list[str]) -> tuple[TokenizedDataset, bool, str]:
    """One source tokenized: a verified, memory-mapped cache entry, or streamed through the encoder in parallel
    and written to the cache (kept in memory when there is no cache). Returns (data, cache hit, its identity)."""
    identity = data_identity(f"{source.fingerprint()}:{limit}", tokenizer, encoder)
    path = cache_dir / "tokenized" / f"{cache_key(identity)}.safetensors" if cache_dir is not None else None
    dataset, hit = tokenize_source(source, limit, encoder, tokenizer, path, warnings)
    return dataset, hit, identity


@dataclass
class _SourceData:
    train: TokenizedDataset
    eval: TokenizedDataset | None
    hit: bool
    fingerprint: str


def _source_data(data: DataSection, source: SourceSection, key: str, tokenizer, seed: int, base_dir: Path,
                 cache_dir: Path | None, warnings: list[str]) -> _SourceData:
    """One source tokenized (through the cache), with its eval examples: a file of its own, a split of a
    single `path`, or rows held out by a seeded shuffle."""
    encoder = make_encoder(data, tokenizer, source)
    location = resolve_source(source.path, base_dir, source.split, key)
    train, hit, fingerprint = _tokenized(location, source.max_rows, encoder, tokenizer, cache_dir, warnings)
    evaluation = None
    eval_split = data.eval_split if data.datasets is None else None
    if eval_split and location.kind == "file":
        raise UserError(f"data.eval_split = {eval_split!r}: {source.path} is a single file with no splits",
                        hint="use data.eval_path for a separate file, or data.eval_rows to hold out rows")
    if source.eval_path or eval_split:
        eval_key = key.rsplit(".", 1)[0] + ".eval_path"
        eval_location = (resolve_source(source.eval_path, base_dir, "train", eval_key) if source.eval_path
                         else DataSource(location.kind, location.location, eval_split))
        evaluation, _, _ = _tokenized(eval_location, None, encoder, tokenizer, cache_dir, warnings)
    elif source.eval_rows:
        check_held_out(key.rsplit(".", 1)[0], source.eval_rows, len(train),
                       f"the data has {len(train)} usable examples")
        # Held-out rows are chosen by a seeded shuffle that does not depend on the epoch.
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
        evaluation = train.subset(sorted(order[: source.eval_rows]))
        stats = train.stats
        train = train.subset(sorted(order[source.eval_rows:]))
        train.stats, evaluation.stats = _split_stats(stats, evaluation)
        fingerprint = f"{fingerprint}-holdout{source.eval_rows}"  # the held-out rows change what is trained on
    if len(train) == 0:
        raise UserError(f"{key}: no usable training examples in {source.path} "
                        f"({train.stats.dropped_no_target} had no target tokens within max_length)")
    return _SourceData(train, evaluation, hit, fingerprint)


def _split_stats(whole: TokenStats, held_out: TokenizedDataset) -> tuple[TokenStats, TokenStats]:
    """(training, held-out) stats of a source whose eval_rows were held out: the summary and the tokenize manifest
    count only what trains. Held-out rows are kept examples, so rows, examples and tokens split exactly; which
    examples were truncated is not stored, so `truncated` stays the whole source's."""
    tokens, targets = held_out.token_counts()
    held = TokenStats(rows=len(held_out), kept=len(held_out), tokens=tokens, target_tokens=targets)
    return TokenStats(rows=whole.rows - held.rows, kept=whole.kept - held.kept, truncated=whole.truncated,
                      dropped_no_target=whole.dropped_no_target, tokens=whole.tokens - tokens,
                      target_tokens=whole.target_tokens - targets), held


def build_data(data: DataSection, tokenizer, *, micro_batch_size: int, seed: int, base_dir: Path,
               use_cache: bool = True, sampler: str | None = None, resuming: bool = False) -> DataBundle:
    """`sampler`: the concrete sampler when data.sampler is `auto` (the run resolves it from the model).
    `resuming`: a run that started before its recipe's settings were checked against a tokenized directory's
    continues (a warning), its data fingerprint checked as always."""
    if data.tokenized_path:
        return _from_tokenized_dir(data, tokenizer, micro_batch_size, seed, base_dir, sampler, resuming)
    cache_dir = (Path(data.cache_dir) if data.cache_dir else default_cache_dir()) if use_cache else None
    if cache_dir is not None and not cache_dir.is_absolute():
        cache_dir = base_dir / cache_dir
    warnings: list[str] = []
    sources = data.sources()
    parts = [_source_data(data, source, "data.path" if data.datasets is None else f"data.datasets[{number}].path",
                          tokenizer, seed, base_dir, cache_dir, warnings) for number, source in enumerate(sources)]
    mixture = _mixture(sources, parts, seed)
    train = concat_datasets([part.train for part in parts])
    evals = [part.eval for part in parts if part.eval is not None]
    evaluation = concat_datasets(evals) if evals else None
    kind = sampler or (data.sampler if data.sampler != "auto" else "random")
    sequences = sequences_per_example(source.format for source in sources)
    # Packed rows hold at least one whole example (a pair: both sequences).
    plan = BatchPlan(train.lengths, micro_batch_size, seed, kind, data.max_length * sequences, mixture)
    fingerprint = parts[0].fingerprint if data.datasets is None else _mixture_fingerprint(mixture, parts)
    return DataBundle(train, evaluation, plan, all(part.hit for part in parts), fingerprint, warnings, mixture,
                      [part.train.stats for part in parts], sequences == 2)


def _from_tokenized_dir(data: DataSection, tokenizer, micro_batch_size: int, seed: int, base_dir: Path,
                        sampler: str | None, resuming: bool = False) -> DataBundle:
    """Data `gpupoor tokenize` wrote (verified against its manifest and this tokenizer), with its mixture. Its
    held-out eval rows were chosen when it was written; this run's seed orders the epochs."""
    path = Path(data.tokenized_path).expanduser()
    path = path if path.is_absolute() else base_dir / path
    train, evaluation, manifest = load_tokenized_dir(path, tokenizer)
    warnings = []
    try:
        check_tokenized_settings(manifest, data, path)
    except UserError as exc:
        if not resuming:
            raise
        warnings.append(f"{exc.message}; resuming as the run started (the directory's settings apply)")
    mixture = manifest_mixture(manifest, seed)
    kind = sampler or (data.sampler if data.sampler != "auto" else "random")
    plan = BatchPlan(train.lengths, micro_batch_size, seed, kind, manifest["max_length"], mixture)
    return DataBundle(train, evaluation, plan, True, manifest["data_fingerprint"], warnings, mixture,
                      manifest_source_stats(manifest))


def _mixture(sources: list[SourceSection], parts: list[_SourceData], seed: int) -> Mixture:
    sizes = [len(part.train) for part in parts]
    for number, (source, size) in enumerate(zip(sources, sizes)):
        if source.rows is not None:  # only data.datasets sources have rows
            check_rows(f"data.datasets[{number}].rows", source.rows, size)
    counts = source_counts(sizes, [s.weight for s in sources], [s.rows for s in sources], [s.epochs for s in sources])
    placed, start, eval_start = [], 0, 0
    for source, part, count in zip(sources, parts, counts):
        eval_size = len(part.eval) if part.eval is not None else 0
        placed.append(Source(source.name, start, start + len(part.train), count, eval_start, eval_start + eval_size))
        start, eval_start = start + len(part.train), eval_start + eval_size
    return Mixture(placed, seed)


def _mixture_fingerprint(mixture: Mixture, parts: list[_SourceData]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for source, part in zip(mixture.sources, parts):
        digest.update(f"{source.name}:{source.count}:{part.fingerprint};".encode())
    return digest.hexdigest()[:32]


def collate(dataset: TokenizedDataset, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels (-100 on padding and prompts)."""
    examples = [dataset[i] for i in indices]
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(examples):
        input_ids[row, : len(ids)] = ids
        labels[row, : len(ids)] = lab
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def collate_packed(dataset: TokenizedDataset, indices: list[int], row_length: int | None = None,
                   pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Whole examples end to end in rows of at most `row_length` tokens (first-fit-decreasing), rows padded
    to the longest with a filler block. position_ids restart at 0 for each example (and the filler) and
    there is no attention_mask: transformers then masks attention block-diagonally, so no example sees
    another (with the KV cache off, which training always has). The first token of each example is never
    a target, so the last token of one example is not trained to predict the next example."""
    lengths = dataset.lengths
    rows = first_fit_decreasing(indices, lengths, row_length or sum(lengths[i] for i in indices))
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids, labels, positions, real = [], [], [], []
    for row in rows:
        row_ids, row_labels, row_positions = [], [], []
        for index in row:
            example_ids, example_labels = dataset[index]
            example_labels = example_labels.clone()
            example_labels[0] = IGNORE_INDEX
            row_ids.append(example_ids)
            row_labels.append(example_labels)
            row_positions.append(torch.arange(len(example_ids)))
        used = sum(len(piece) for piece in row_ids)
        filler = width - used  # its own block: positions restart at 0, nothing attends across, no targets
        row_ids.append(torch.full((filler,), pad_id, dtype=torch.long))
        row_labels.append(torch.full((filler,), IGNORE_INDEX, dtype=torch.long))
        row_positions.append(torch.arange(filler))
        ids.append(torch.cat(row_ids))
        labels.append(torch.cat(row_labels))
        positions.append(torch.cat(row_positions))
        real.append(torch.arange(width) < used)
    return {"input_ids": torch.stack(ids), "labels": torch.stack(labels), "position_ids": torch.stack(positions),
            "token_mask": torch.stack(real)}


def collate_pairs(dataset: TokenizedDataset, indices: list[int], pad_id: int,
                  row_length: int | None = None) -> dict[str, torch.Tensor]:
    """A micro-batch of preference pairs, each pair whole: padded rows [chosen_1..chosen_B, rejected_1..rejected_B]
    (`row_length` None), or packed: whole pairs bin-packed into rows of at most `row_length` tokens, each sequence
    its own block (position_ids restart, its first token no target) as collate_packed does.

    Beside the model inputs, `sequence_index` (the shape of labels) says which sequence each target belongs to:
    2p for the chosen answer of the micro-batch's pair p, 2p + 1 for its rejected one, -1 where there is no
    target; the losses sum log-probabilities per sequence with it, the same way for both layouts."""
    pairs = [dataset.sequences(index) for index in indices]
    if row_length is None:
        rows = [[(pair[0], 2 * p)] for p, pair in enumerate(pairs)] + \
            [[(pair[1], 2 * p + 1)] for p, pair in enumerate(pairs)]
    else:
        lengths = dict(zip(range(len(pairs)), (sum(len(ids) for ids, _ in pair) for pair in pairs)))
        bins = first_fit_decreasing(list(range(len(pairs))), lengths, row_length)
        rows = [[(pairs[p][side], 2 * p + side) for p in row for side in (0, 1)] for row in bins]
    width = max(sum(len(ids) for (ids, _), _ in row) for row in rows)
    batch = {name: torch.full((len(rows), width), fill, dtype=torch.long)
             for name, fill in (("input_ids", pad_id), ("labels", IGNORE_INDEX), ("sequence_index", -1),
                                ("attention_mask", 0), ("position_ids", 0))}
    for number, row in enumerate(rows):
        at = 0
        for (ids, labels), sequence in row:
            end = at + len(ids)
            batch["input_ids"][number, at:end] = ids
            batch["labels"][number, at + 1:end] = labels[1:]  # (packed: never the previous sequence's next token)
            batch["sequence_index"][number, at + 1:end] = torch.where(labels[1:] != IGNORE_INDEX, sequence, -1)
            batch["attention_mask"][number, at:end] = 1
            batch["position_ids"][number, at:end] = torch.arange(len(ids))
            at = end
        batch["position_ids"][number, at:] = torch.arange(width - at)  # packed filler: a block of its own
    if row_length is None:
        del batch["position_ids"]  # padded rows: the attention mask; packed rows: restarted positions, no mask
    else:
        batch["token_mask"] = batch.pop("attention_mask").bool()
    return batch


def count_pairs(batch: dict[str, torch.Tensor]) -> int:
    """Preference pairs in a micro-batch (collate_pairs numbers their sequences 0 .. 2 x pairs - 1)."""
    return int(batch["sequence_index"].max()) // 2 + 1


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-padding) tokens in a batch."""
    mask = batch.get("attention_mask", batch.get("token_mask"))
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Target tokens the loss will use: labels after the causal shift that are not ignored."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
