"""DistributedDataParallel and FSDP2 (fully_shard) with gloo on 2 CPU processes (loopback): the gradients
of a model built on the block equal a single process's on the same global batch."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastmha

GLOBAL_BATCH, LENGTH, D_MODEL = 8, 10, 32


def make_model():
    torch.manual_seed(0)
    return nn.ModuleDict({"attention": fastmha.MultiHeadAttentionBlock(D_MODEL, 4, 0.0), "head": nn.Linear(D_MODEL, 1)})


def loss_of(model, x, mask):
    return model["head"](model["attention"](x, x, x, mask)).mean()


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, LENGTH, D_MODEL, generator=g)
    mask = torch.rand(GLOBAL_BATCH, 1, 1, LENGTH, generator=g) > 0.2
    return x, mask


def finish():
    dist.barrier()  # no collective still in flight when the group is torn down
    dist.destroy_process_group()
    # Leave without running static destructors: gloo's threads occasionally abort the process there
    # ("terminate called without an active exception", about 1 run in 8, after the results are written).
    os._exit(0)


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = make_model()

    def forward(self, x, mask):
        return loss_of(self.inner, x, mask)


def start(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)


def backward_on_shard(model, rank, world):
    x, mask = data()
    shard = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    model(x[shard], mask[shard]).backward()


def ddp_worker(rank, world, init_file, out_file):
    start(rank, world, init_file)
    model = nn.parallel.DistributedDataParallel(Wrapped())
    backward_on_shard(model, rank, world)  # DDP averages the gradients across ranks
    if rank == 0:
        torch.save({name: p.grad for name, p in model.module.named_parameters()}, out_file)
    finish()


def fsdp_worker(rank, world, init_file, out_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    start(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    model = Wrapped()
    fully_shard(model.inner["attention"], mesh=mesh)  # FSDP2: the block's weights are sharded across ranks
    fully_shard(model, mesh=mesh)
    backward_on_shard(model, rank, world)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, out_file)
    finish()


def assert_matches_single_process(worker, tmp_path):
    out_file = str(tmp_path / "grads.pt")
    mp.spawn(worker, args=(2, str(tmp_path / "init"), out_file), nprocs=2, join=True)
    distributed_grads = torch.load(out_file)
    single = Wrapped()
    x, mask = data()
    single(x, mask).backward()
    for name, p in single.named_parameters():
        torch.testing.assert_close(distributed_grads[name], p.grad, rtol=1e-5, atol=1e-6)


def test_ddp_gloo_two_processes_matches_single_process(tmp_path):
    assert_matches_single_process(ddp_worker, tmp_path)


def test_fsdp2_fully_shard_two_processes_matches_single_process(tmp_path):
    assert_matches_single_process(fsdp_worker, tmp_path)
