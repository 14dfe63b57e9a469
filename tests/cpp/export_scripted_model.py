"""Scripts a small layer built on fastmha.MultiHeadAttentionBlock and saves it, with inputs and Python's
outputs, for the C++ test that loads it (usage: export_scripted_model.py OUT_DIR)."""

import sys
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

import fastmha


class Layer(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.attention = fastmha.MultiHeadAttentionBlock(d_model, heads, 0.1)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        return self.norm(x + self.attention(x, x, x, mask))


class Tensors(nn.Module):
    def __init__(self, **tensors: Tensor):
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


def main(out_dir: Path) -> None:
    torch.manual_seed(0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = Layer(16, 4).eval()
    x = torch.randn(2, 5, 16)
    mask = (torch.rand(2, 1, 1, 5) > 0.2).to(torch.int64)
    torch.jit.script(model).save(str(out_dir / "model.pt"))
    torch.jit.script(Tensors(x=x, mask=mask, expected=model(x, mask).detach())).save(str(out_dir / "data.pt"))
    print(f"saved model.pt and data.pt in {out_dir}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
