"""A small sequence-to-sequence Transformer (encoder self-attention with padding masks, decoder masked
self-attention, cross-attention; embeddings, sinusoidal positions, feed-forward, layer norm), with its
attention blocks made by a factory: fastmha.MultiHeadAttentionBlock, or the oracle block for comparison.

The model scripts with torch.jit.script; `translate` (greedy decoding) is exported so that C++ runs it too.
"""

import math
from typing import Callable, List

import torch
from torch import Tensor, nn

PAD, BOS, EOS = 0, 1, 2
FIRST_DIGIT = 3  # tokens 3..12 are the digits 0..9
VOCAB = FIRST_DIGIT + 10


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, max_len: int = 64):
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        rate = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * rate)
        pe[:, 1::2] = torch.cos(position * rate)
        self.register_buffer("pe", pe)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.pe[: x.size(1)].to(x.dtype)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float, attention: Callable):
        super().__init__()
        self.self_attn = attention(d_model, heads, dropout)
        self.feed_forward = FeedForward(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.dropout(self.self_attn(h, h, h, src_mask))
        return x + self.dropout(self.feed_forward(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float, attention: Callable):
        super().__init__()
        self.self_attn = attention(d_model, heads, dropout)
        self.cross_attn = attention(d_model, heads, dropout)
        self.feed_forward = FeedForward(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, y: Tensor, memory: Tensor, src_mask: Tensor, tgt_mask: Tensor) -> Tensor:
        h = self.norm1(y)
        y = y + self.dropout(self.self_attn(h, h, h, tgt_mask))
        h = self.norm2(y)
        y = y + self.dropout(self.cross_attn(h, memory, memory, src_mask))
        return y + self.dropout(self.feed_forward(self.norm3(y)))


class Seq2Seq(nn.Module):
    def __init__(self, attention: Callable, d_model: int = 64, heads: int = 4, d_ff: int = 128, layers: int = 2,
                 dropout: float = 0.1):
        super().__init__()
        self.d_model = d_model
        self.pad, self.bos, self.eos = PAD, BOS, EOS  # attributes, so TorchScript sees them
        self.src_embed = nn.Embedding(VOCAB, d_model, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(VOCAB, d_model, padding_idx=PAD)
        self.position = PositionalEncoding(d_model)
        self.encoder = nn.ModuleList([EncoderLayer(d_model, heads, d_ff, dropout, attention) for _ in range(layers)])
        self.decoder = nn.ModuleList([DecoderLayer(d_model, heads, d_ff, dropout, attention) for _ in range(layers)])
        self.encoder_norm = nn.LayerNorm(d_model)
        self.decoder_norm = nn.LayerNorm(d_model)
        self.generator = nn.Linear(d_model, VOCAB)
        self.dropout = nn.Dropout(dropout)

    def add_position(self, embedded: Tensor) -> Tensor:
        # Unscaled embeddings (no sqrt(d_model)): at this size the positions must stay as loud as the tokens.
        return self.dropout(self.position(embedded))

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        x = self.add_position(self.src_embed(src))
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def decode(self, memory: Tensor, src_mask: Tensor, tgt: Tensor) -> Tensor:
        length = tgt.size(1)
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=tgt.device))
        tgt_mask = (tgt != self.pad)[:, None, None, :] & causal  # (batch, 1, T, T)
        y = self.add_position(self.tgt_embed(tgt))
        for layer in self.decoder:
            y = layer(y, memory, src_mask, tgt_mask)
        return self.generator(self.decoder_norm(y))

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        src_mask = (src != self.pad)[:, None, None, :]  # (batch, 1, 1, S): padding keys are not attended
        return self.decode(self.encode(src, src_mask), src_mask, tgt)

    @torch.jit.export
    def translate(self, src: Tensor, max_len: int) -> Tensor:
        """Greedy decoding: (batch, S) source tokens -> (batch, <= max_len) output tokens after BOS."""
        src_mask = (src != self.pad)[:, None, None, :]
        memory = self.encode(src, src_mask)
        out = torch.full((src.size(0), 1), self.bos, dtype=torch.long, device=src.device)
        done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            logits = self.decode(memory, src_mask, out)
            next_token = logits[:, -1].argmax(-1)
            next_token = torch.where(done, torch.full_like(next_token, self.pad), next_token)
            out = torch.cat([out, next_token[:, None]], dim=1)
            done = done | (next_token == self.eos)
            if bool(done.all()):
                break
        return out[:, 1:]


def digits_to_tokens(text: str) -> List[int]:
    return [FIRST_DIGIT + int(c) for c in text]


def tokens_to_digits(tokens: List[int]) -> str:
    out = []
    for t in tokens:
        if t == EOS or t == PAD:
            break
        out.append(str(t - FIRST_DIGIT) if t >= FIRST_DIGIT else "?")
    return "".join(out)


def make_batch(batch: int, min_len: int, max_len: int, generator: torch.Generator):
    """The task: translate a digit string into its reverse. Returns src, decoder input and target, padded."""
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=generator)
    src = torch.full((batch, max_len), PAD, dtype=torch.long)
    tgt_in = torch.full((batch, max_len + 1), PAD, dtype=torch.long)
    tgt_out = torch.full((batch, max_len + 1), PAD, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        digits = torch.randint(0, 10, (n,), generator=generator) + FIRST_DIGIT
        src[i, :n] = digits
        tgt_in[i, 0] = BOS
        tgt_in[i, 1:n + 1] = digits.flip(0)
        tgt_out[i, :n] = digits.flip(0)
        tgt_out[i, n] = EOS
    return src, tgt_in, tgt_out
