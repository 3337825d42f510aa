"""A batch as vLLM's attention backends see it: per-request lengths, token offsets, pages and slots.

Each step the scheduler hands the model a *batch*: for every request, the tokens it already has in the cache
(``context_len``, vLLM's ``num_computed_tokens``) and the tokens it runs now (``query_len``, ``new_tokens``).
The new tokens of all requests are packed one after another into one token axis ``T``::

    request            0          1                2
    context_len        5          0                7           tokens already cached
    query_len          1          4                2           tokens run this step
    seq_len            6          4                9           = context_len + query_len
    query_start_loc  [0,         1,               5,         7]  = cumsum([0] + query_len)
    token t          0 | 1  2  3  4 | 5  6                      T = 7

and each request owns pages of ``block_size`` (``P``) cache slots listed in its row of ``block_table``; the
new token at position ``pos`` of request ``b`` is written to::

    slot_mapping[t] = block_table[b, pos // P] * P + pos % P

MLA runs *decodes* (short queries, memory bound) through the absorbed form and *prefills* (long queries,
compute bound) through the compute-friendly form, so backends first **reorder** the batch to put decodes first
(:func:`reorder_batch_to_split_decodes_and_prefills`), then find the boundary
(:func:`split_decodes_and_prefills`). Local ("chunked") attention models split each request into
attention-chunk-sized virtual requests (:func:`make_local_attention_virtual_batches`).

Sources: vLLM ``vllm/v1/attention/backends/utils.py`` (``CommonAttentionMetadata``, ``split_decodes_and_prefills``,
``reorder_batch_to_split_decodes_and_prefills``, ``make_local_attention_virtual_batches``); the metadata record
itself lives in ``vllm/v1/attention/backend.py`` in newer versions. Two versions of the reorder exist:

* **seed** (the vLLM doc page this project started from; vLLM V1 up to about 0.10): two regions, decode
  (``query_len <= threshold``) then prefill, reached with the fewest possible swaps;
* **0.33** (the newest stored ``utils.py``): four regions, decode / short extend / long extend / prefill,
  classified by context and prompt progress, reached by following permutation cycles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from .checks import BOOL, INT, Dims, boolean, choice, positive_int

__all__ = [
    "REGION_NAMES",
    "CommonAttentionMetadata",
    "LocalVirtualBatches",
    "Reordered",
    "Request",
    "SplitCounts",
    "build_metadata",
    "make_local_attention_virtual_batches",
    "reorder_batch_to_split_decodes_and_prefills",
    "request_region",
    "split_decodes_and_prefills",
]


@dataclass(frozen=True)
class Request:
    """One request's share of a step.

    Args:
        context_len: tokens already in the cache (vLLM ``num_computed_tokens``), ``>= 0``.
        new_tokens: tokens scheduled this step (the query length), ``>= 0`` (0 only as CUDA-graph padding).
        prompt_len: the prompt's length, used only by the 0.33 four-region reorder to tell a chunked prefill
            still eating its prompt (``context_len < prompt_len``) from a decode. ``None`` means the prompt is
            already consumed whenever ``context_len > 0`` (a request past its prefill).
    """

    context_len: int
    new_tokens: int
    prompt_len: int | None = None

    def __post_init__(self):
        positive_int("context_len", self.context_len, minimum=0)
        positive_int("new_tokens", self.new_tokens, minimum=0)
        if self.prompt_len is not None:
            positive_int("prompt_len", self.prompt_len, minimum=1)

    @property
    def seq_len(self) -> int:
        """``context_len + new_tokens``."""
        return self.context_len + self.new_tokens

    @property
    def is_prefilling(self) -> bool:
        """Still consuming its prompt: ``context_len < prompt_len`` (vLLM 0.33 ``is_prefilling``)."""
        if self.prompt_len is None:
            return self.context_len == 0
        return self.context_len < self.prompt_len


def _as_int_tensor(name: str, x: object, shape: tuple, dims: Dims) -> torch.Tensor:
    return dims.tensor(name, x, shape, INT)


@dataclass(frozen=True, eq=False)
class CommonAttentionMetadata:
    """Per-batch attention metadata shared by every layer (vLLM ``CommonAttentionMetadata``), validated.

    Fields (``B`` requests, ``T`` new tokens, ``max_blocks`` block-table columns):

    * ``query_start_loc``: ``[B + 1]`` int32, starts at 0, non-decreasing, ends at ``T``.
    * ``seq_lens``: ``[B]`` int32, ``num_computed_tokens + query_lens``.
    * ``num_computed_tokens``: ``[B]`` int32, the context lengths.
    * ``block_table``: ``[B, max_blocks]`` int32, page ids; row ``b`` must list valid pages (``0 <= id < num_blocks``)
      for its first ``ceil(seq_lens[b] / block_size)`` columns. Later columns are ignored (``-1`` here; vLLM
      leaves whatever was there).
    * ``slot_mapping``: ``[T]`` int64, the cache slot of each new token,
      ``block_table[b, pos // block_size] * block_size + pos % block_size``.
    * ``is_prefilling``: ``[B]`` bool, still consuming the prompt (vLLM 0.33; used by the four-region split).
    * ``block_size`` (``P``), ``num_blocks`` (pages in the cache; slots live in ``[0, num_blocks * P)``).
    * ``num_actual_tokens``: optional int ``>= T``, the token count vLLM's kernels run over. Default (None) ``T =
      query_start_loc[-1]``; larger under CUDA-graph padding, where the batch is padded to a captured size: the
      padded tokens belong to no request (vLLM gives them ``slot_mapping = -1``, ``PAD_SLOT_ID``; the spec's
      ``slot_mapping`` lists only the ``T`` real tokens). :func:`split_decodes_and_prefills` counts them with the
      last side, as vLLM does.
    * Derived scalars as in vLLM: ``num_reqs``, ``max_query_len``, ``max_seq_len``, and ``num_tokens`` (``T``).

    Construction checks every invariant and raises ``ValueError`` naming the field that disagrees
    (non-monotonic ``query_start_loc``, ``seq_lens`` that disagree with the other lengths, a slot past the
    cache, ...). Use :func:`build_metadata` to build one from a list of :class:`Request`.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    is_prefilling: torch.Tensor
    block_size: int
    num_blocks: int
    num_actual_tokens: int | None = None

    def __post_init__(self):
        positive_int("block_size", self.block_size)
        positive_int("num_blocks", self.num_blocks, minimum=0)
        dims = Dims()
        qsl = _as_int_tensor("query_start_loc", self.query_start_loc, ("B_plus_1",), dims)
        b = qsl.numel() - 1
        if b < 0:
            raise ValueError("query_start_loc must have B + 1 >= 1 entries, got an empty tensor")
        if self.num_actual_tokens is None:
            object.__setattr__(self, "num_actual_tokens", int(qsl[-1]))
        positive_int("num_actual_tokens", self.num_actual_tokens, minimum=max(int(qsl[-1]), 0))
        dims = Dims().bind("query_start_loc", B=b)
        seq_lens = _as_int_tensor("seq_lens", self.seq_lens, ("B",), dims)
        computed = _as_int_tensor("num_computed_tokens", self.num_computed_tokens, ("B",), dims)
        table = _as_int_tensor("block_table", self.block_table, ("B", "max_blocks"), dims)
        slots = _as_int_tensor("slot_mapping", self.slot_mapping, ("T",), dims)
        dims.tensor("is_prefilling", self.is_prefilling, ("B",), BOOL)
        if int(qsl[0]) != 0:
            raise ValueError(f"query_start_loc must start at 0, got {qsl.tolist()}")
        if bool((qsl[1:] < qsl[:-1]).any()):
            raise ValueError(f"query_start_loc must be non-decreasing, got {qsl.tolist()}")
        if int(qsl[-1]) != slots.numel():
            raise ValueError(f"query_start_loc must end at T={slots.numel()} (from slot_mapping), got {qsl.tolist()}")
        if bool((computed < 0).any()):
            raise ValueError(f"num_computed_tokens must be >= 0, got {computed.tolist()}")
        query_lens = qsl[1:] - qsl[:-1]
        if not torch.equal(seq_lens.long(), (computed + query_lens).long()):
            raise ValueError(
                f"seq_lens must equal num_computed_tokens + query lengths = {(computed + query_lens).tolist()}, "
                f"got {seq_lens.tolist()}"
            )
        p = self.block_size
        pages_needed = (seq_lens.long() + p - 1) // p
        if b and int(pages_needed.max()) > table.shape[1]:
            raise ValueError(
                f"block_table must have at least {int(pages_needed.max())} columns for seq_lens {seq_lens.tolist()}"
                f" with block_size={p}, got shape {list(table.shape)}"
            )
        for r in range(b):
            row = table[r, : int(pages_needed[r])]
            if bool(((row < 0) | (row >= self.num_blocks)).any()):
                raise ValueError(
                    f"block_table row {r} must hold page ids in [0, num_blocks={self.num_blocks}) for its first "
                    f"{int(pages_needed[r])} pages, got {row.tolist()}"
                )
        if bool(((slots < 0) | (slots >= self.num_blocks * p)).any()):
            raise ValueError(
                f"slot_mapping must lie in the cache [0, num_blocks * block_size = {self.num_blocks * p}), "
                f"got {slots.tolist()}"
            )
        expected = _slots_from_table(table, computed, query_lens, p)
        if not torch.equal(slots.long(), expected):
            bad = int((slots.long() != expected).nonzero()[0])
            raise ValueError(
                f"slot_mapping must follow block_table (slot = block_table[b, pos // P] * P + pos % P); token {bad} "
                f"should be {int(expected[bad])}, got {int(slots[bad])}"
            )

    # -- vLLM's derived scalars -------------------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        """``B``."""
        return self.query_start_loc.numel() - 1

    @property
    def num_tokens(self) -> int:
        """``T = query_start_loc[-1]``, the real new tokens of the whole batch (``<= num_actual_tokens``)."""
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> torch.Tensor:
        """``[B]`` int64, ``query_start_loc[1:] - query_start_loc[:-1]``."""
        return (self.query_start_loc[1:] - self.query_start_loc[:-1]).long()

    @property
    def max_query_len(self) -> int:
        """Longest query (0 for an empty batch)."""
        return int(self.query_lens.max()) if self.num_reqs else 0

    @property
    def max_seq_len(self) -> int:
        """Longest sequence (0 for an empty batch)."""
        return int(self.seq_lens.max()) if self.num_reqs else 0

    def token_request(self) -> torch.Tensor:
        """``[T]`` int64: the request each new token belongs to."""
        return torch.repeat_interleave(torch.arange(self.num_reqs), self.query_lens)

    def token_positions(self) -> torch.Tensor:
        """``[T]`` int64: each new token's position in its sequence (``context_len + i``)."""
        req = self.token_request()
        start = self.query_start_loc[:-1].long()
        return self.num_computed_tokens.long()[req] + torch.arange(self.num_tokens) - start[req]


def _slots_from_table(table: torch.Tensor, computed: torch.Tensor, query_lens: torch.Tensor, p: int) -> torch.Tensor:
    """``slot = block_table[b, pos // P] * P + pos % P`` for every new token (int64 ``[T]``)."""
    req = torch.repeat_interleave(torch.arange(computed.numel()), query_lens.long())
    starts = torch.cumsum(query_lens.long(), 0) - query_lens.long()
    pos = computed.long()[req] + torch.arange(req.numel()) - starts[req]
    return table.long()[req, pos // p] * p + pos % p


def build_metadata(
    requests: Sequence[Request],
    *,
    block_size: int,
    block_table: torch.Tensor | None = None,
    num_blocks: int | None = None,
    num_actual_tokens: int | None = None,
) -> CommonAttentionMetadata:
    """Build :class:`CommonAttentionMetadata` for ``requests`` in the given order.

    Args:
        requests: the batch, in batch order.
        block_size: ``P``, cache slots per page (vLLM's ``block_size``; FlashMLA needs 64).
        block_table: optional ``[B, max_blocks]`` int page ids. Default: an identity-like allocation, request ``b``
            gets the next ``ceil(seq_len_b / P)`` pages after request ``b - 1``'s, unused columns ``-1``.
        num_blocks: pages in the cache; default ``max page id + 1`` (at least 1).
        num_actual_tokens: the padded token count (CUDA graphs), ``>= T``; default ``T``.

    Returns:
        The validated metadata; ``slot_mapping`` is computed from ``block_table``.

    Example::

        m = build_metadata([Request(5, 1), Request(0, 4), Request(7, 2)], block_size=4)
        m.query_start_loc  # [0, 1, 5, 7]
        m.seq_lens         # [6, 4, 9]
        m.block_table      # [[0, 1, -1], [2, -1, -1], [3, 4, 5]]
        m.slot_mapping     # [5, 8, 9, 10, 11, 19, 20]
    """
    if not isinstance(requests, Sequence) or not all(isinstance(r, Request) for r in requests):
        raise TypeError("requests must be a sequence of Request")
    positive_int("block_size", block_size)
    b = len(requests)
    context = torch.tensor([r.context_len for r in requests], dtype=torch.int32)
    query_lens = torch.tensor([r.new_tokens for r in requests], dtype=torch.int32)
    seq_lens = context + query_lens
    qsl = torch.zeros(b + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(query_lens, 0)
    pages = [math.ceil(r.seq_len / block_size) for r in requests]
    if block_table is None:
        width = max(pages, default=0)
        block_table = torch.full((b, max(width, 1)), -1, dtype=torch.int32)
        nxt = 0
        for i, n in enumerate(pages):
            block_table[i, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32)
            nxt += n
    else:
        Dims().bind("requests", B=b).tensor("block_table", block_table, ("B", "max_blocks"), INT)
        block_table = block_table.to(torch.int32).clone()
    if num_blocks is None:
        num_blocks = max(int(block_table.max()) + 1 if block_table.numel() else 1, 1)
    positive_int("num_blocks", num_blocks, minimum=0)
    used = [block_table[i, : pages[i]] for i in range(b)]
    if any(bool(((u < 0) | (u >= num_blocks)).any()) for u in used):
        raise ValueError(
            f"block_table must hold page ids in [0, num_blocks={num_blocks}) for the pages each request needs "
            f"({pages}), got {block_table.tolist()}"
        )
    if any(pages[i] > block_table.shape[1] for i in range(b)):
        raise ValueError(f"block_table must have at least {max(pages)} columns, got shape {list(block_table.shape)}")
    slots = _slots_from_table(block_table, context, query_lens, block_size) if b else torch.zeros(0, dtype=torch.int64)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        num_computed_tokens=context,
        block_table=block_table,
        slot_mapping=slots,
        is_prefilling=torch.tensor([r.is_prefilling for r in requests], dtype=torch.bool),
        block_size=block_size,
        num_blocks=num_blocks,
        num_actual_tokens=num_actual_tokens,
    )


# -- split ------------------------------------------------------------------------------------------------------


class SplitCounts(NamedTuple):
    """The decode / prefill boundary of a reordered batch (vLLM returns the same four ints)."""

    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int


def split_decodes_and_prefills(
    metadata: CommonAttentionMetadata,
    decode_threshold: int = 1,
    require_uniform: bool = False,
    treat_short_extends_as_decodes: bool = True,
) -> SplitCounts:
    """Find the boundary between the leading decodes and the trailing prefills of a reordered batch.

    Math (``q = query_lens``, ``B`` requests, ``T`` tokens)::

        is_prefill[b] = q[b] > decode_threshold                       (default)
                      = q[b] != q[0] and q[b] != 0   if require_uniform   (decodes share one length;
                                                                          0 is CUDA-graph padding)
                      |= is_prefilling[b]       if not treat_short_extends_as_decodes
        num_decodes   = first b with is_prefill[b]      (B if none; 0 if q[0] > decode_threshold)
        num_decode_tokens = query_start_loc[num_decodes]

    With ``require_uniform`` and ``treat_short_extends_as_decodes``, a batch whose every query has length ``q[0]``
    or 0 is all decodes. (Both the ``q[b] != 0`` term and the ``treat_short_extends_as_decodes`` condition of that
    shortcut are vLLM 0.33's; an earlier reading of the source left them out, so a padding row ``q = 0`` *before*
    the first longer query counted as the first prefill. The ``vllm`` conformance backend, which runs 0.33's own
    function, found it.)

    Everything after the first prefill counts as a prefill, including a short first chunk (``q <= threshold``,
    no context), which the 0.33 reorder places in its last region.

    A decode may have several query tokens (``1 < q <= decode_threshold``: MTP / speculative decoding).

    Args:
        metadata: the batch, already reordered decodes first.
        decode_threshold: the longest query still treated as a decode (vLLM ``reorder_batch_threshold``).
        require_uniform: decodes must share one query length (backends without varlen decode; vLLM's MLA
            builder passes ``query_len_support != VARLEN``).
        treat_short_extends_as_decodes: 0.33 only; ``False`` sends short chunked-prefill pieces
            (``q <= threshold`` but still prefilling) to the prefill side.

    **Padded batch** (CUDA graphs): the token counts add up to ``metadata.num_actual_tokens``, not ``T``, as
    vLLM's do (it reads ``num_tokens = num_actual_tokens``): the padding tokens go to the prefill side when there
    is a prefill (``num_prefill_tokens = num_actual_tokens - query_start_loc[num_decodes]``) and to the decode side
    when every request is a decode (``num_decode_tokens = num_actual_tokens``). Example: query lengths ``[1, 1]``
    padded to 4 tokens give ``(2, 0, 4, 0)``; ``[1, 3]`` padded to 8 give ``(1, 1, 1, 7)``.

    Returns:
        :class:`SplitCounts`. ``num_decodes + num_prefills == B`` and the token counts add up to
        ``num_actual_tokens`` (``T`` unless padded).

    Raises:
        ValueError: ``metadata`` is not reordered: a short query *with* context (a decode) after the first
            prefill, the first request included (not checked with ``require_uniform``, where vLLM sends such rows
            to the prefill side).

    Source: vLLM ``vllm/v1/attention/backends/utils.py`` (``split_decodes_and_prefills``, 0.33 signature;
    ``require_uniform`` and ``treat_short_extends_as_decodes`` are absent in the seed version, whose behaviour
    is the defaults).
    """
    if not isinstance(metadata, CommonAttentionMetadata):
        raise TypeError(f"metadata must be a CommonAttentionMetadata, got {type(metadata).__name__}")
    positive_int("decode_threshold", decode_threshold)
    boolean("require_uniform", require_uniform)
    boolean("treat_short_extends_as_decodes", treat_short_extends_as_decodes)
    b, t = metadata.num_reqs, metadata.num_actual_tokens
    if b == 0:
        return SplitCounts(0, 0, t, 0)  # vLLM: max_query_len 0 <= threshold, all (padding) tokens to the decodes
    q = metadata.query_lens
    if (
        metadata.max_query_len <= decode_threshold
        and (not require_uniform or decode_threshold <= 1)
        and treat_short_extends_as_decodes
    ):
        return SplitCounts(b, 0, t, 0)
    if int(q[0]) > decode_threshold:  # no decodes; what follows must be prefills too
        _check_reordered(
            metadata,
            _long_or_prefilling(metadata, decode_threshold, treat_short_extends_as_decodes),
            0,
            require_uniform,
        )
        return SplitCounts(0, b, 0, t)
    if require_uniform:
        if treat_short_extends_as_decodes and bool(((q == q[0]) | (q == 0)).all()):
            return SplitCounts(b, 0, t, 0)
        is_prefill = (q != q[0]) & (q != 0)  # a padding row (q = 0) is never the first prefill
        if not treat_short_extends_as_decodes:
            is_prefill = is_prefill | metadata.is_prefilling
    else:
        is_prefill = _long_or_prefilling(metadata, decode_threshold, treat_short_extends_as_decodes)
    if not bool(is_prefill.any()):
        return SplitCounts(b, 0, t, 0)
    first = int(is_prefill.int().argmax())
    _check_reordered(metadata, is_prefill, first, require_uniform)
    d_tok = int(metadata.query_start_loc[first])
    return SplitCounts(first, b - first, d_tok, t - d_tok)


def _long_or_prefilling(metadata: CommonAttentionMetadata, decode_threshold: int, short_extends_decode: bool):
    """``[B]`` bool: ``q > decode_threshold``, or still prefilling when short extends count as prefills."""
    is_prefill = metadata.query_lens > decode_threshold
    return is_prefill if short_extends_decode else is_prefill | metadata.is_prefilling


def _check_reordered(
    metadata: CommonAttentionMetadata, is_prefill: torch.Tensor, first: int, require_uniform: bool
) -> None:
    """After the first prefill (request ``first``) only prefills may follow: the split's documented ``Raises``.

    A short query *without* context is a 1-token first chunk, which 0.33's four-region order puts in the prefill
    region, so it counts as a prefill (as in vLLM); a short query *with* context is a decode (or short extend) out
    of place: the batch was not reordered. With ``require_uniform`` vLLM sends such rows to the prefill side, so
    they are not checked.
    """
    if require_uniform:
        return
    q = metadata.query_lens
    misplaced = ~is_prefill[first:] & (metadata.num_computed_tokens[first:] > 0)
    if bool(misplaced.any()):
        late = first + int(misplaced.nonzero()[0])
        raise ValueError(
            f"metadata must be reordered decodes first (reorder_batch_to_split_decodes_and_prefills): request {late} "
            f"(query_len {int(q[late])}, context {int(metadata.num_computed_tokens[late])}) is a decode after the "
            f"first prefill, request {first}"
        )


# -- reorder ----------------------------------------------------------------------------------------------------

REGION_NAMES = {2: ("decode", "prefill"), 4: ("decode", "short_extend", "long_extend", "prefill")}


def request_region(request: Request, decode_threshold: int = 1, regions: Literal[2, 4] = 4) -> int:
    """The region a request belongs to (index into ``REGION_NAMES[regions]``).

    Two regions (seed)::

        0 decode   new_tokens <= threshold
        1 prefill  otherwise

    Four regions (0.33), ``has_context = context_len > 0``::

        0 decode        has_context and new_tokens <= threshold and not is_prefilling
        1 short_extend  has_context and new_tokens <= threshold and is_prefilling
        2 long_extend   has_context and new_tokens >  threshold
        3 prefill       not has_context   (a first chunk, whatever its length)
    """
    if not isinstance(request, Request):
        raise TypeError(f"request must be a Request, got {type(request).__name__}")
    positive_int("decode_threshold", decode_threshold)
    short = request.new_tokens <= decode_threshold
    choice("regions", regions, (2, 4))
    if regions == 2:
        return 0 if short else 1
    if request.context_len == 0:
        return 3
    if not short:
        return 2
    return 1 if request.is_prefilling else 0


class Reordered(NamedTuple):
    """Result of a reorder.

    * ``requests``: the batch after the swaps.
    * ``order``: ``order[i]`` is the original index of the request now at position ``i``.
    * ``swaps``: the ``(i, j)`` position swaps, in the order applied (vLLM's ``input_batch.swap_states``).
    * ``regions``: the region of each request after the swaps (non-decreasing).
    """

    requests: tuple[Request, ...]
    order: tuple[int, ...]
    swaps: tuple[tuple[int, int], ...]
    regions: tuple[int, ...]

    @property
    def modified(self) -> bool:
        """vLLM's return value: whether any swap happened."""
        return bool(self.swaps)


def reorder_batch_to_split_decodes_and_prefills(
    requests: Sequence[Request],
    decode_threshold: int = 1,
    *,
    regions: Literal[2, 4] = 4,
) -> Reordered:
    """Reorder a batch so that its regions (decodes first) are contiguous, by swapping requests in place.

    **Seed version** (``regions=2``; vLLM V1 until ~0.10, doc seed 003): decodes are requests with
    ``new_tokens <= decode_threshold``. With ``D`` decodes, every decode at position ``>= D`` is misplaced and
    so is every prefill at position ``< D``; there are equally many of each (``m``). Pair the ``i``-th misplaced
    decode from the *back* with the ``i``-th prefill from the *front* and swap::

        for i in 1 .. min(#decodes, #prefills):
            d = decodes[-i]                      # i-th decode from the back
            if d < D: break                      # the rest are already in place
            swap(prefills[i - 1], d)

    That is ``m`` swaps, the minimum: one swap can fix at most one misplaced decode.

    **0.33 version** (``regions=4``): classify with :func:`request_region`; the ``k``-th misplaced request
    (sorted by its region, stable) goes to the ``k``-th misplaced position (ascending), and each cycle of that
    permutation is closed with ``len(cycle) - 1`` swaps. This is minimal when only two regions are out of
    place but not in general: a 3-cycle of three regions takes 2 swaps even if two 2-cycles elsewhere could
    be paired differently (see the tests, which compare it with a brute-force minimum).

    Args:
        requests: the persistent batch in its current order.
        decode_threshold: vLLM ``reorder_batch_threshold`` (``1 + num_speculative_tokens`` with MTP).
        regions: ``2`` for the seed's decode/prefill split, ``4`` for vLLM 0.33's.

    Returns:
        :class:`Reordered`.

    Source: vLLM ``vllm/v1/attention/backends/utils.py`` (``reorder_batch_to_split_decodes_and_prefills``).
    """
    if not isinstance(requests, Sequence) or not all(isinstance(r, Request) for r in requests):
        raise TypeError("requests must be a sequence of Request")
    choice("regions", regions, (2, 4))
    positive_int("decode_threshold", decode_threshold)
    batch = list(requests)
    order = list(range(len(batch)))
    region = [request_region(r, decode_threshold, regions) for r in batch]
    swaps: list[tuple[int, int]] = []

    def swap(i: int, j: int) -> None:
        for xs in (batch, order, region):
            xs[i], xs[j] = xs[j], xs[i]
        swaps.append((i, j))

    if regions == 2:
        decodes = [i for i, g in enumerate(region) if g == 0]
        prefills = [i for i, g in enumerate(region) if g == 1]
        n_dec = len(decodes)
        for i in range(1, min(n_dec, len(prefills)) + 1):
            d = decodes[n_dec - i]
            if d < n_dec:
                break
            swap(prefills[i - 1], d)
    else:
        counts = [region.count(g) for g in range(4)]
        target = [g for g in range(4) for _ in range(counts[g])]
        misplaced = [i for i in range(len(batch)) if region[i] != target[i]]
        by_region = sorted(misplaced, key=lambda i: region[i])  # stable: ties keep position order
        dest = dict(zip(by_region, misplaced))  # element now at `src` must move to `dest[src]`
        for src in list(dest):
            dst = dest[src]
            while src != dst:  # walk the cycle through src, one swap per step
                swap(src, dst)
                nxt = dest.get(dst, dst)
                dest[dst] = dst
                dst = nxt
    return Reordered(tuple(batch), tuple(order), tuple(swaps), tuple(region))


# -- local attention --------------------------------------------------------------------------------------------


class LocalVirtualBatches(NamedTuple):
    """Local attention as ordinary causal attention over virtual requests (one per attention chunk touched).

    * ``metadata``: a :class:`CommonAttentionMetadata` over the ``B_local`` virtual requests (same tokens, same
      ``slot_mapping``; ``block_table = block_table_local``).
    * ``seqlens_q_local [B_local]``, ``cu_seqlens_q_local [B_local + 1]``, ``seqlens_k_local [B_local]``: int32.
    * ``block_table_local [B_local, attn_chunk_size // block_size]`` int32.
    * ``k_seqstarts_absolute [B_local]`` int32: where each virtual request's keys start in its real sequence.
    * ``request [B_local]`` int64: the real request each virtual one came from.
    """

    metadata: CommonAttentionMetadata
    seqlens_q_local: torch.Tensor
    cu_seqlens_q_local: torch.Tensor
    seqlens_k_local: torch.Tensor
    block_table_local: torch.Tensor
    k_seqstarts_absolute: torch.Tensor
    request: torch.Tensor


def make_local_attention_virtual_batches(
    attn_chunk_size: int,
    metadata: CommonAttentionMetadata,
    block_size: int | None = None,
) -> LocalVirtualBatches:
    """Split each request into virtual requests, one per attention chunk its new tokens fall in.

    Local (chunked) attention, as in Llama 4: query at position ``p`` sees key ``j`` iff ``j <= p`` and
    ``j // L == p // L`` (``L = attn_chunk_size``). For request ``b`` (context ``c``, sequence ``s``) and every
    chunk ``k`` from ``c // L`` to ``(s - 1) // L``::

        k_start = k * L,  k_end = min(k_start + L, s)
        queries   max(c, k_start) .. k_end - 1      -> seqlens_q_local = k_end - max(c, k_start)
        keys      k_start .. k_end - 1              -> seqlens_k_local = k_end - k_start
        pages     block_table[b, k_start // P : k_start // P + L // P]   (column index clipped to max_blocks - 1)

    Plain bottom-right causal attention inside each virtual request then equals local attention.

    Worked example (the vLLM docstring): ``L = 4``, query lens ``[4, 10, 5]``, seq lens ``[6, 17, 9]``::

        seqlens_q_local    = [2, 2, 1, 4, 4, 1, 4, 1]
        cu_seqlens_q_local = [0, 2, 4, 5, 9, 13, 14, 18, 19]
        seqlens_k_local    = [4, 2, 4, 4, 4, 1, 4, 1]
        k_seqstarts        = [0, 4, 4, 8, 12, 16, 4, 8]
        block_table_local (P = 2, rows of block_table = [0..9], [10..19], [20..29]):
            [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]

    (vLLM's comment lists ``cu_seqlens_q_local = [0, 4, 6, 10, 14, 18, 19, 23, 24]``, which does not match
    its own ``seqlens_q_local``; the code computes the cumulative sum shown here.)

    Args:
        attn_chunk_size: ``L``, a multiple of ``block_size``.
        metadata: the batch; every request must have at least one new token.
        block_size: page size; default ``metadata.block_size``.

    Returns:
        :class:`LocalVirtualBatches`.

    Source: vLLM ``vllm/v1/attention/backends/utils.py`` (``make_local_attention_virtual_batches``).
    """
    if not isinstance(metadata, CommonAttentionMetadata):
        raise TypeError(f"metadata must be a CommonAttentionMetadata, got {type(metadata).__name__}")
    positive_int("attn_chunk_size", attn_chunk_size)
    p = metadata.block_size if block_size is None else positive_int("block_size", block_size)
    if p != metadata.block_size:
        raise ValueError(f"block_size must equal metadata.block_size={metadata.block_size}, got {p}")
    if attn_chunk_size % p:
        raise ValueError(f"attn_chunk_size must be a multiple of block_size={p}, got {attn_chunk_size}")
    q_lens = metadata.query_lens
    if bool((q_lens <= 0).any()):
        raise ValueError(f"metadata must have at least one new token per request, got query lengths {q_lens.tolist()}")
    c_size, pages_per = attn_chunk_size, attn_chunk_size // p
    width = metadata.block_table.shape[1]
    sq, sk, starts, req, tables, computed, prefilling = [], [], [], [], [], [], []
    for b in range(metadata.num_reqs):
        c, s = int(metadata.num_computed_tokens[b]), int(metadata.seq_lens[b])
        for k in range(c // c_size, (s - 1) // c_size + 1):
            k_start = k * c_size
            k_end = min(k_start + c_size, s)
            q_first = max(c, k_start)
            sq.append(k_end - q_first)
            sk.append(k_end - k_start)
            computed.append(q_first - k_start)
            starts.append(k_start)
            req.append(b)
            prefilling.append(bool(metadata.is_prefilling[b]))
            cols = [min(k_start // p + i, width - 1) for i in range(pages_per)]
            tables.append(metadata.block_table[b, cols])
    i32 = dict(dtype=torch.int32)
    seqlens_q = torch.tensor(sq, **i32)
    cu = torch.zeros(len(sq) + 1, **i32)
    cu[1:] = torch.cumsum(seqlens_q, 0)
    seqlens_k = torch.tensor(sk, **i32)
    table_local = torch.stack(tables).to(torch.int32)
    local = CommonAttentionMetadata(
        query_start_loc=cu,
        seq_lens=seqlens_k,
        num_computed_tokens=torch.tensor(computed, **i32),
        block_table=table_local,
        slot_mapping=metadata.slot_mapping,
        is_prefilling=torch.tensor(prefilling, dtype=torch.bool),
        block_size=p,
        num_blocks=metadata.num_blocks,
        num_actual_tokens=metadata.num_actual_tokens,
    )
    return LocalVirtualBatches(
        local, seqlens_q, cu, seqlens_k, table_local, torch.tensor(starts, **i32), torch.tensor(req, dtype=torch.int64)
    )
