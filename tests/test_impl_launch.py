"""``mlaspec.impl.launch.Launcher``: a compiled kernel launched again directly, under a key of what Triton specializes
its arguments on. Without a GPU, against a stand-in kernel that records what is called; on a Hopper GPU, against
Triton itself: the key must give the very compiled kernel Triton's launch returns for the same arguments."""

from __future__ import annotations

import pytest
import torch
from triton import knobs

from mlaspec.impl.launch import Launcher


class Compiled:
    """A compiled kernel's stand-in: records its direct launches."""

    def __init__(self, log: list) -> None:
        self.function, self.packed_metadata, self.log = "function", "metadata", log

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit, *bound):
        self.log.append(("direct", (g0, g1, g2), stream, bound))


class Kernel:
    """A JIT kernel's stand-in: ``kernel[grid](*args, **kwargs)`` compiles (once a key) and launches."""

    arg_names = ("X", "n", "BLOCK")

    def __init__(self) -> None:
        self.log: list = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return Compiled(self.log)

        return launch


@pytest.fixture
def cuda_free(monkeypatch):
    """The device and stream queries answered without a GPU."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)


def kinds(log: list) -> list[str]:
    return [entry[0] for entry in log]


def test_the_second_call_with_the_same_key_launches_directly(cuda_free):
    kernel = Kernel()
    launch = Launcher(kernel)
    x = torch.zeros(64)
    launch((4,), (x, 32), {"BLOCK": 16}, num_warps=4)
    launch((5, 2), (x, 48), {"BLOCK": 16}, num_warps=4)  # 48 % 16 == 0 as 32: the same key
    assert kinds(kernel.log) == ["jit", "direct"]
    assert kernel.log[0][1:] == ((4,), (x, 32), {"BLOCK": 16, "num_warps": 4})
    _, grid, stream, bound = kernel.log[1]
    assert grid == (5, 2, 1) and stream == 1234
    assert bound[0] is x and bound[1:] == (48, 16)  # the arguments, then the constexprs in order


@pytest.mark.parametrize(
    "change",
    [
        lambda x: ((x, 1), {"BLOCK": 16}, {}),  # an integer of 1 (Triton makes it a constant)
        lambda x: ((x, 33), {"BLOCK": 16}, {}),  # not a multiple of 16
        lambda x: ((x, 2**31), {"BLOCK": 16}, {}),  # beyond 32 bits
        lambda x: ((x[1:], 32), {"BLOCK": 16}, {}),  # an address 4 bytes off 16
        lambda x: ((x.half(), 32), {"BLOCK": 16}, {}),  # another dtype
        lambda x: ((x, 32), {"BLOCK": 32}, {}),  # another constexpr
        lambda x: ((x, 32), {"BLOCK": 16}, {"num_warps": 8}),  # another option
    ],
)
def test_what_triton_specializes_on_is_a_new_key(cuda_free, change):
    kernel = Kernel()
    launch = Launcher(kernel)
    x = torch.zeros(64)
    launch((4,), (x, 32), {"BLOCK": 16}, num_warps=4)
    args, constexprs, options = change(x)
    launch((4,), args, constexprs, **{"num_warps": 4, **options})
    assert kinds(kernel.log) == ["jit", "jit"]


def test_launch_hooks_and_another_launcher_go_through_triton(cuda_free, monkeypatch):
    kernel = Kernel()
    launch = Launcher(kernel)
    x = torch.zeros(64)
    launch((4,), (x, 32), {"BLOCK": 16})
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch((4,), (x, 32), {"BLOCK": 16})  # a profiler watches every launch: Triton's own
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)

    def other_signature(self, grid):  # a Triton whose launcher takes other arguments
        raise TypeError("unexpected arguments")

    monkeypatch.setattr(Compiled, "run", other_signature)
    launch((4,), (x, 32), {"BLOCK": 16})
    launch((4,), (x, 32), {"BLOCK": 16})
    assert kinds(kernel.log) == ["jit", "jit", "jit", "jit"] and not launch.direct


def test_constexprs_out_of_order_are_refused(cuda_free):
    class Two(Kernel):
        arg_names = ("X", "A", "B")

    with pytest.raises(ValueError, match="constexprs must be"):
        Launcher(Two())((1,), (torch.zeros(4),), {"B": 1, "A": 2})


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU (the Gluon indexer kernel)")
@pytest.mark.parametrize("M,N", [(1, 1), (2, 16), (17, 33), (64, 1024), (300, 4096)])
@pytest.mark.parametrize("offset", [0, 1])
def test_the_key_gives_the_kernel_triton_launches(M, N, offset):
    """The indexer's Gluon kernel through a :class:`Launcher`: on the second call it launches directly the very
    compiled kernel Triton's launch returns for those arguments (lengths of 1, multiples of 16 and not; weights and
    spans 4 bytes off 16), and the logits are those of Triton's launch."""
    from mlaspec.impl import indexer_sm90 as g

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(M * N)
    q = torch.randn(M, 64, 128, device=dev, generator=gen).to(torch.float8_e4m3fn)
    k = torch.randn(N, 128, device=dev, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(M + offset, 64, device=dev, generator=gen)[offset:]
    ks = torch.zeros(M + offset, dtype=torch.int32, device=dev)[offset:]
    ke = torch.arange(N - M + 1, N + 1 + offset, dtype=torch.int32, device=dev).clamp(0, N)[offset:]
    tiles = g.tiles_for(M, N, torch.cuda.get_device_properties(dev).multi_processor_count)
    constexprs = dict(H=64, D=128, BLOCK_N=g.BLOCK_N, TILES=tiles, STAGES=g.STAGES, HAS_SCALE=False)
    grid = (g.programs(M, N, tiles),)
    outs = [torch.full((M, N), float("nan"), device=dev) for _ in range(2)]
    launch = Launcher(g.logits_kernel)
    compiled = []
    for out in outs:  # the first call compiles through Triton, the second launches directly
        args = (q, k, w, ks, ke, w, out, M, N, out.stride(0))
        compiled.append(launch(grid, args, constexprs, num_warps=g.NUM_WARPS))
    reference = torch.full((M, N), float("nan"), device=dev)
    args = (q, k, w, ks, ke, w, reference, M, N, reference.stride(0))
    assert g.logits_kernel[grid](*args, **constexprs, num_warps=g.NUM_WARPS) is compiled[0] is compiled[1]
    torch.testing.assert_close(outs[1], reference, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(outs[0], reference, rtol=0, atol=0, equal_nan=True)
