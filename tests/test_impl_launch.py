"""``mlaspec.impl.launch.Launcher``: a compiled kernel launched again directly, under a key of what Triton specializes
its arguments on. Without a GPU, against a stand-in kernel that records what is called; on a Hopper GPU, against
Triton itself: the key must give the very compiled kernel Triton's launch returns for the same arguments."""

from __future__ import annotations

import pytest
import torch
from triton import knobs

from mlaspec.impl.launch import Launcher, _spec


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


def test_integers_are_keyed_by_their_triton_type():
    """32-bit, 64-bit and unsigned 64-bit integers compile to different kernels; within a type only 1 and the
    multiples of 16 stand apart."""
    assert _spec(5) == _spec(-7) == _spec(2**31 - 1) != _spec(2**31 + 1) == _spec(-(2**31) - 3) != _spec(2**63 + 1)
    assert _spec(32) == _spec(-(2**31)) != _spec(33) and _spec(1) != _spec(17)
    assert _spec(True) != _spec(1) and _spec(None) != _spec(0) and _spec(1.5) == _spec(2.0) != _spec(2)


def test_options_and_constexprs_are_keyed_by_name(cuda_free):
    kernel = Kernel()
    launch = Launcher(kernel)
    x = torch.zeros(64)
    launch((4,), (x, 32), {"BLOCK": 16}, num_warps=4)
    launch((4,), (x, 32), {"BLOCK": 16}, num_stages=4)  # the same value under another name
    launch((4,), ((x, x), 32), {"BLOCK": 16}, num_warps=4)  # a tuple argument: not keyed, Triton's launch
    launch((4,), ((x, x), 32), {"BLOCK": 16}, num_warps=4)
    assert kinds(kernel.log) == ["jit", "jit", "jit", "jit"]


def test_launch_hooks_and_another_launcher_go_through_triton(cuda_free, monkeypatch):
    kernel = Kernel()
    launch = Launcher(kernel)
    x = torch.zeros(64)
    launch((4,), (x, 32), {"BLOCK": 16})
    enter = knobs.runtime.launch_enter_hook
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch((4,), (x, 32), {"BLOCK": 16})  # a profiler watches every launch: Triton's own
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", enter)
    chain = knobs.runtime.launch_exit_hook
    if hasattr(chain, "add"):  # triton >= 3.5: hooks are chains, a profiler adds to them
        hook = lambda *a: None
        chain.add(hook)
        try:
            launch((4,), (x, 32), {"BLOCK": 16})
        finally:
            chain.remove(hook)
    else:
        launch((4,), (x, 32), {"BLOCK": 16}, num_warps=8)  # a new key: Triton's launch, as with the hook

    def other_signature(self, grid):  # a Triton whose launcher takes other arguments
        raise TypeError("unexpected arguments")

    monkeypatch.setattr(Compiled, "run", other_signature)
    launch((4,), (x, 32), {"BLOCK": 16})
    launch((4,), (x, 32), {"BLOCK": 16})
    assert kinds(kernel.log) == ["jit"] * 5 and not launch.direct


def test_constexprs_out_of_order_are_refused(cuda_free):
    class Two(Kernel):
        arg_names = ("X", "A", "B")

    with pytest.raises(ValueError, match="constexprs must be"):
        Launcher(Two())((1,), (torch.zeros(4),), {"B": 1, "A": 2})


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU (the Gluon indexer kernel)")
def test_the_key_gives_the_kernel_triton_launches():
    """The indexer's Gluon kernel through one :class:`Launcher` over argument sets that Triton compiles apart (M, N of
    1, 16, 17, 33, 1024; weights and spans 4 bytes off 16): a set's first call goes through Triton's launch unless an
    earlier set had its key, its second launches directly, and what it launches is the very compiled kernel Triton's
    launch returns for those arguments (a key too coarse would hand one set another's); the logits are those of
    Triton's launch."""
    from mlaspec.impl import indexer_sm90 as g

    class Counted:  # the kernel, its launches through Triton counted
        arg_names = g.logits_kernel.arg_names

        def __init__(self) -> None:
            self.launches = 0

        def __getitem__(self, grid):
            self.launches += 1
            return g.logits_kernel[grid]

    dev = torch.device("cuda")
    kernel = Counted()
    launch = Launcher(kernel)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sets = [(M, N, off) for M, N in [(1, 1), (2, 16), (17, 33), (64, 1024), (300, 4096)] for off in (0, 1)]
    for i, (M, N, off) in enumerate(sets):
        gen = torch.Generator(device=dev).manual_seed(i)
        q = torch.randn(M, 64, 128, device=dev, generator=gen).to(torch.float8_e4m3fn)
        k = torch.randn(N, 128, device=dev, generator=gen).to(torch.float8_e4m3fn)
        w = torch.randn(M * 64 + off, device=dev, generator=gen)[off:].view(M, 64)  # 4 bytes off 16 where off
        ks = torch.zeros(M + off, dtype=torch.int32, device=dev)[off:]
        ke = torch.arange(N - M + 1, N + 1 + off, dtype=torch.int32, device=dev).clamp(0, N)[off:]
        tiles = g.tiles_for(M, N, sms)
        constexprs = dict(H=64, D=128, BLOCK_N=g.BLOCK_N, TILES=tiles, STAGES=g.STAGES, HAS_SCALE=False)
        grid = (g.programs(M, N, tiles),)
        outs = [torch.full((M, N), float("nan"), device=dev) for _ in range(3)]
        before = kernel.launches
        compiled = [launch(grid, (q, k, w, ks, ke, w, outs[0], M, N, N), constexprs, num_warps=4)]
        first = kernel.launches  # one more, or none where an earlier set had the same key
        compiled.append(launch(grid, (q, k, w, ks, ke, w, outs[1], M, N, N), constexprs, num_warps=4))
        assert first - before in (0, 1) and kernel.launches == first and launch.direct, (M, N, off)
        reference = g.logits_kernel[grid](q, k, w, ks, ke, w, outs[2], M, N, N, **constexprs, num_warps=4)
        assert reference is compiled[0] is compiled[1], (M, N, off)
        for out in outs[:2]:
            torch.testing.assert_close(out, outs[2], rtol=0, atol=0, equal_nan=True)
