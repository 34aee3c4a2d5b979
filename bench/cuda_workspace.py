"""How much CUDA memory torch's allocator holds for cuBLAS before any activation exists: allocated bytes after one
bf16 matmul on the main thread, then after a backward (autograd's device thread takes its own cuBLAS handle).
The plan's `cuda_workspace` term (gpupoor.plan.peak) is this; run on a GPU: python bench/cuda_workspace.py"""

import torch

x = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
tensors = torch.cuda.memory_allocated()
y = x @ w
torch.cuda.synchronize()
forward = torch.cuda.memory_allocated() - tensors - y.numel() * y.element_size()
y.float().sum().backward()
torch.cuda.synchronize()
grads = x.grad.numel() * 2 + w.grad.numel() * 2
backward = torch.cuda.memory_allocated() - tensors - y.numel() * y.element_size() - grads
print(f"{torch.cuda.get_device_name(0)} (sm{''.join(map(str, torch.cuda.get_device_capability(0)))}): "
      f"held after a forward matmul {forward / 2**20:.2f} MiB, after its backward {backward / 2**20:.2f} MiB")
