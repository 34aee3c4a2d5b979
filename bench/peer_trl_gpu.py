"""The peer on a CUDA GPU: TRL's SFTTrainer + peft LoRA as its docs configure it (prompt/completion data, loss on
the completion only), in bf16. The peer kit's peer_trl.py is the CPU/fp32 version of the same script (use_cpu=True);
this one differs only where a GPU run must: the base loaded in bf16 with SDPA attention, bf16 autocast, and the
peak measured as torch's allocated CUDA memory (what gpupoor's metrics record on CUDA).

    python bench/peer_trl_gpu.py FIXTURE_DIR [--epochs 1] [--batch 8 --seq 1024 --rank 16 --gc --packing]

Prints one JSON line: real (non-pad) tokens, training seconds, tokens/s, peak allocated CUDA MiB, loss.
"""

import argparse
import json
import tempfile
import time

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("--epochs", type=float, default=1)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq", type=int, default=1024)
parser.add_argument("--rank", type=int, default=16)
parser.add_argument("--gc", action="store_true")
parser.add_argument("--packing", action="store_true")
args = parser.parse_args()
torch.manual_seed(0)
cuda_run = torch.cuda.is_available()
tokenizer = AutoTokenizer.from_pretrained(f"{args.dir}/model")
model = AutoModelForCausalLM.from_pretrained(f"{args.dir}/model", dtype=torch.bfloat16 if cuda_run else torch.float32,
                                             attn_implementation="sdpa")
data = load_dataset("json", data_files=f"{args.dir}/data.jsonl", split="train")
data = data.map(lambda r: {"prompt": r["instruction"] + "\n" + r["input"] + "\n", "completion": r["output"]},
                remove_columns=data.column_names)
config = SFTConfig(output_dir=tempfile.mkdtemp(prefix="peer_trl_gpu_"), per_device_train_batch_size=args.batch,
                   num_train_epochs=args.epochs, max_length=args.seq, packing=args.packing,
                   gradient_checkpointing=args.gc, logging_steps=1, save_strategy="no", report_to=[],
                   learning_rate=2e-4, dataloader_num_workers=0, disable_tqdm=True, seed=0, bf16=cuda_run,
                   use_cpu=not cuda_run)
trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                     peft_config=LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))
seen = {"tokens": 0}
compute_loss = trainer.compute_loss


def counting(model, inputs, *rest, **kwargs):
    mask = inputs.get("attention_mask")
    seen["tokens"] += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
    return compute_loss(model, inputs, *rest, **kwargs)


trainer.compute_loss = counting
cuda = cuda_run  # False only on the CPU dry run of bench/gpu.py
if cuda:
    torch.cuda.reset_peak_memory_stats()
started = time.perf_counter()
out = trainer.train()
if cuda:
    torch.cuda.synchronize()
seconds = time.perf_counter() - started
print(json.dumps({"tool": "trl-sft+peft", "packing": args.packing, "gc": args.gc, "tokens": seen["tokens"],
                  "seconds": round(seconds, 2), "tokens_per_s": round(seen["tokens"] / seconds, 1),
                  "peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2**20) if cuda else 0,
                  "loss": round(out.training_loss, 4)}))
