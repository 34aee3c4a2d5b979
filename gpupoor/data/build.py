"""build_data: the recipe's data section -> tokenized train/eval sets and a batch plan; collate to tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpupoor.data.dataset import CacheEntryInvalid, TokenizedDataset, cache_key, tokenize_rows
from gpupoor.data.formats import IGNORE_INDEX, Encoder
from gpupoor.data.loading import DataSource, read_rows, resolve_source
from gpupoor.data.sampler import BatchPlan, first_fit_decreasing
from gpupoor.errors import UserError
from gpupoor.files import default_cache_dir
from gpupoor.recipe import DataSection


@dataclass
class DataBundle:
    train: TokenizedDataset
    eval: TokenizedDataset | None
    plan: BatchPlan
    cache_hit: bool
    fingerprint: str  # identity of the tokenized training data (data bytes, tokenizer, format settings)
    warnings: list[str] = field(default_factory=list)  # e.g. a cache entry that failed its check

    def collate(self, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        """A training micro-batch: packed into one row when the sampler packs, else padded."""
        if self.plan.kind == "packed":
            return collate_packed(self.train, indices, self.plan.row_length, pad_id)
        return collate(self.train, indices, pad_id)


def make_encoder(data: DataSection, tokenizer) -> Encoder:
    return Encoder(tokenizer, data.format, data.max_length, data.train_on_prompt, data.text_field,
                   data.messages_field, data.chat_template)


def _tokenized(source: DataSource, limit: int | None, encoder: Encoder, tokenizer,
               cache_dir: Path | None, warnings: list[str]) -> tuple[TokenizedDataset, bool, str]:
    key = cache_key(f"{source.fingerprint()}:{limit}", tokenizer, encoder)
    if cache_dir is None:
        return tokenize_rows(read_rows(source, limit), encoder), False, key
    path = cache_dir / "tokenized" / f"{key}.safetensors"
    if path.is_file():
        try:
            return TokenizedDataset.load(path), True, key
        except CacheEntryInvalid as exc:  # a miss: tokenize again and replace the entry
            warnings.append(f"tokenized cache entry {path} is invalid ({exc}): tokenizing the data again")
    dataset = tokenize_rows(read_rows(source, limit), encoder)
    try:
        dataset.save(path)
    except OSError as exc:  # a cache that cannot be written costs time next run, never this run
        warnings.append(f"could not write the tokenized cache {path} ({exc.strerror or exc}); set data.cache_dir "
                        "or $GPUPOOR_CACHE to a writable folder")
    return dataset, False, key


def build_data(data: DataSection, tokenizer, micro_batch_size: int, seed: int, base_dir: Path,
               use_cache: bool = True, sampler: str | None = None) -> DataBundle:
    """`sampler`: the concrete sampler when data.sampler is `auto` (the run resolves it from the model)."""
    encoder = make_encoder(data, tokenizer)
    cache_dir = (Path(data.cache_dir) if data.cache_dir else default_cache_dir()) if use_cache else None
    if cache_dir is not None and not cache_dir.is_absolute():
        cache_dir = base_dir / cache_dir
    source = resolve_source(data.path, base_dir, data.split, "data.path")
    warnings: list[str] = []
    train, hit, fingerprint = _tokenized(source, data.max_rows, encoder, tokenizer, cache_dir, warnings)
    evaluation = None
    if data.eval_split and source.kind == "file":
        raise UserError(f"data.eval_split = {data.eval_split!r}: {data.path} is a single file with no splits",
                        hint="use data.eval_path for a separate file, or data.eval_rows to hold out rows")
    if data.eval_path or data.eval_split:
        eval_source = (resolve_source(data.eval_path, base_dir, "train", "data.eval_path") if data.eval_path
                       else DataSource(source.kind, source.location, data.eval_split))
        evaluation, _, _ = _tokenized(eval_source, None, encoder, tokenizer, cache_dir, warnings)
    elif data.eval_rows:
        if data.eval_rows >= len(train):
            raise UserError(f"data.eval_rows = {data.eval_rows} leaves no training rows "
                            f"(the data has {len(train)} usable examples)")
        # Held-out rows are chosen by a seeded shuffle that does not depend on the epoch.
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
        evaluation = train.subset(sorted(order[: data.eval_rows]))
        stats = train.stats
        train = train.subset(sorted(order[data.eval_rows:]))
        train.stats = stats
    if len(train) == 0:
        raise UserError(f"data.path: no usable training examples in {data.path} "
                        f"({train.stats.dropped_no_target} had no target tokens within max_length)")
    kind = sampler or (data.sampler if data.sampler != "auto" else "random")
    plan = BatchPlan(train.lengths, micro_batch_size, seed, kind, data.max_length)
    if data.eval_rows:  # the held-out rows change what is trained on
        fingerprint = f"{fingerprint}-holdout{data.eval_rows}"
    return DataBundle(train, evaluation, plan, hit, fingerprint, warnings)


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


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-padding) tokens in a batch."""
    mask = batch.get("attention_mask", batch.get("token_mask"))
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Target tokens the loss will use: labels after the causal shift that are not ignored."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
