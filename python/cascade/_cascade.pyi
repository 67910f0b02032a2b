"""cascade's kernels and generation (see the package cascade)"""

from collections.abc import Iterator, Sequence


from typing import Any, Protocol
class Array(Protocol):
    """A NumPy array or a PyTorch CPU tensor (float32, float16 or bfloat16 elements where a kernel reads it;
    int8 codes and float16 scales in a Q8_0)."""
    @property
    def shape(self) -> Any: ...
    @property
    def dtype(self) -> Any: ...

def merge_state(o_a: Array, lse_a: Array, o_b: Array, lse_b: Array) -> tuple[Any, Any]:
    """
    The exact merge of two attention states: (o, lse) of the union of their keys.

    o_a, o_b: (..., head_dim), float32, float16 or bfloat16; lse_a, lse_b: (...), float32, natural log.
    An empty state is (0, -inf): merging with it is the identity, two empty states give an empty one.
    Returns (o, lse): o in o_a's dtype, lse float32, in o_a's framework (NumPy or PyTorch).
    """

def merge_state_in_place(o_a: Array, lse_a: Array, o_b: Array, lse_b: Array) -> None:
    """merge_state, written into o_a and lse_a (which must be writable)."""

def merge_states(o: Array, lse: Array) -> tuple[Any, Any]:
    """
    The exact merge of n attention states stacked on the first axis.

    o: (n, ..., head_dim), lse: (n, ...). Returns (o, lse) of shapes (..., head_dim) and (...); n = 0 gives
    empty states (0, -inf).
    """

class Q8_0:
    """
    q8_0 K or V, as Plan.run, Plan.bind and the layouts take them: Q8_0(codes, scales).

    codes: int8, (tokens, n_kv_heads, head_dim); scales: float16, (tokens, n_kv_heads, head_dim // 32), one per
    32 codes of a head's row: element i of a row is codes[..., i] * scales[..., i // 32] (head_dim a multiple of
    32). NumPy arrays or PyTorch CPU tensors, read in place: dense, or views whose scales' strides are the codes'
    divided by 32 (slices of both along the token axis are). quantize_q8_0(x) makes one from float values;
    `codes, scales = q` unpacks it; q.dequantize() gives the float32 values the kernels see.
    """

    def __init__(self, codes: Array, scales: Array) -> None: ...

    @property
    def codes(self) -> Any:
        """The int8 codes, as given."""

    @property
    def scales(self) -> Any:
        """The float16 scales, as given."""

    def __iter__(self) -> Iterator[Any]:
        """codes, then scales: `codes, scales = q`."""

    def dequantize(self) -> Any:
        """
        The values as float32 (codes times their scales), in the codes' framework.
        """

    def __repr__(self) -> str: ...

def quantize_q8_0(x: Array) -> Q8_0:
    """
    x (..., head_dim) of float32, float16 or bfloat16 as q8_0, by the library's quantizer: a Q8_0 of int8 codes
    (x's shape) and float16 scales (x's shape with head_dim // 32), in x's framework. Each block of 32 values
    gets the scale d = float16(max |x| / 127) and codes round(x / d) (to nearest even, within [-127, 127]), so
    every value is within d / 2 of what is stored; a block holding a NaN or an infinity reads back as NaN.
    head_dim must be a multiple of 32.
    """

class CostModel:
    """
    auto's cost model of this machine: calibrate() measures one, save()/load() keep it.
    """

    @staticmethod
    def calibrate(threads: int = 0, n_kv_heads: int = 4, head_dim: int = 64, kv_dtype: object = 'float16') -> CostModel:
        """
        Fits the cost model on this machine (about half a second), with the head shape and K/V type it will
        price: the kernels run on kv_dtype's elements ('float32', 'float16', 'bfloat16' or 'q8_0').
        """

    @staticmethod
    def load(path: str) -> CostModel:
        """Reads a profile written by save()."""

    @staticmethod
    def parse(text: str) -> CostModel:
        """Reads a profile from str(model)."""

    def save(self, path: str) -> None: ...

    def __str__(self) -> str: ...

    def __repr__(self) -> str: ...

    @property
    def kv_dtype(self) -> str | None:
        """
        The K/V type it was measured on (None: not recorded); a plan of another kv_dtype refuses it.
        """

    @property
    def threads(self) -> int: ...

    @property
    def n_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def read_bw(self) -> float: ...

    @property
    def small_bw(self) -> float: ...

    @property
    def small_mac(self) -> float: ...

    @property
    def tiled_bw(self) -> float: ...

    @property
    def tiled_mac(self) -> float: ...

    @property
    def item_s(self) -> float: ...

    @property
    def tiled_item_s(self) -> float: ...

class Plan:
    """
    The plan of one step of attention over a tree of K/V segments: made once, run by every layer.

    Plan(segments, paths, n_query=1, *, n_q_heads, n_kv_heads, head_dim, scale=None, window=0,
         method='cascade', cost_model=None, kv_dtype='float16', threads=0)

    segments: the segments' lengths in tokens. paths: per sequence, its segment ids from a root to its leaf
    (its keys are those segments' tokens, in order). n_query: query tokens per sequence (an int for all, or
    a list); they are the last positions of the sequence's keys and attend causally. scale: softmax scale
    (default 1/sqrt(head_dim)). window: a sliding window in keys (0: none): each query row attends only the
    last `window` keys up to and including its own position, as Gemma 3's and Mistral's windowed layers do.
    method: 'cascade' (every segment attended once by all the queries below it)
    or 'auto' (each segment shared or folded into its sequences as a cost model predicts faster; cost_model:
    a CostModel, or None to calibrate once per process). kv_dtype: the K/V type auto prices ('float32',
    'float16', 'bfloat16' or 'q8_0'; a cost_model measured on another type is refused). threads: 0 for all of
    the machine's.

    Query rows are laid out sequence after sequence: sequence s owns rows [row_begin[s], row_begin[s] +
    n_query[s]).
    """

    def __init__(self, segments: Sequence[int], paths: Sequence[Sequence[int]], n_query: int | Sequence[int] = 1, *, n_q_heads: int, n_kv_heads: int, head_dim: int, scale: float | None = None, window: int = 0, method: str = 'cascade', cost_model: CostModel | None = None, kv_dtype: object = 'float16', threads: int = 0) -> None: ...

    @staticmethod
    def two_level(n_prefix: int, n_own: Sequence[int], n_query: int = 1, *, n_q_heads: int, n_kv_heads: int, head_dim: int, scale: float | None = None, window: int = 0, method: str = 'cascade', cost_model: CostModel | None = None, kv_dtype: object = 'float16', threads: int = 0) -> Plan:
        """
        The common tree: one shared prefix (segment 0, n_prefix tokens) and below it one own segment per
        sequence (segment s + 1, n_own[s] tokens), n_query query tokens per sequence. Options as Plan().
        """

    @staticmethod
    def independent(n_tokens: Sequence[int], n_query: int | Sequence[int] = 1, *, n_q_heads: int, n_kv_heads: int, head_dim: int, scale: float | None = None, window: int = 0, method: str = 'cascade', cost_model: CostModel | None = None, kv_dtype: object = 'float16', threads: int = 0) -> Plan:
        """
        Every sequence on its own: sequence s attends only segment s (n_tokens[s] tokens). Options as Plan().
        """

    def run(self, k: Array | Q8_0 | Sequence[Array | Q8_0], v: Array | Q8_0 | Sequence[Array | Q8_0], q: Array, *, starts: Sequence[int] | None = None, out: Array | None = None, lse: Array | None = None) -> tuple[Any, Any]:
        """
        Attention of one layer: returns (o, lse).

        k, v: a list of one array per segment, (tokens, n_kv_heads, head_dim), or one array holding every
        segment's tokens, one segment after another or where starts= says (starts[g]: the token segment g begins
        at, in any order: a cache buffer with the segments anywhere in it); float32, float16 or bfloat16, or q8_0
        as a Q8_0(codes, scales) in place of each array (quantize_q8_0 makes one); read in place (any strides
        with a dense head_dim axis, K and V with the same layout). q: (n_rows, n_q_heads, head_dim), float32,
        float16 or bfloat16. o has q's shape and dtype, lse is (n_rows, n_q_heads) float32 (natural log; -inf for
        a row that sees no key, whose o is 0); both in q's framework, or written into out= and lse=
        (C-contiguous). Computed in float32; the GIL is released meanwhile, so threads may run plans at once.
        """

    def bind(self, k: Array | Q8_0 | Sequence[Array | Q8_0], v: Array | Q8_0 | Sequence[Array | Q8_0], *, starts: Sequence[int] | None = None) -> BoundPlan:
        """
        This plan bound to one layer's K/V: returns a BoundPlan, whose run(q) is Plan.run(k, v, q).

        k, v as Plan.run takes them; they are checked and their layout read once, here, so a bound run costs the
        same whatever the number of segments (Plan.run converts every array on every call). The BoundPlan keeps
        k, v and this plan alive and reads the arrays' memory on every run: K/V written in place between runs
        are seen; an array must not be resized or reallocated in place (ndarray.resize, Tensor.resize_) meanwhile.
        Bind once per layer and step (or once per preallocated buffer) and run it with each step's q.
        """

    @property
    def n_rows(self) -> int: ...

    @property
    def n_segments(self) -> int: ...

    @property
    def n_sequences(self) -> int: ...

    @property
    def n_q_heads(self) -> int: ...

    @property
    def n_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def scale(self) -> float: ...

    @property
    def window(self) -> int: ...

    @property
    def method(self) -> str: ...

    @property
    def threads(self) -> int: ...

    @property
    def segments(self) -> list[int]: ...

    @property
    def paths(self) -> list[list[int]]: ...

    @property
    def n_query(self) -> list[int]: ...

    @property
    def row_begin(self) -> list[int]: ...

    @property
    def workspace_floats(self) -> int: ...

    @property
    def choice(self) -> dict | None:
        """
        auto's decision (None for method='cascade'): changed, predicted_tree_s, predicted_chosen_s,
        and per segment shared (attended once) and n_passes (passes over its K/V).
        """

    def kernels(self, kv_dtype: object = 'float16') -> dict:
        """
        The kernels this plan runs on K/V of kv_dtype, chosen when it was made: {'shared': ..., 'per_sequence':
        ...} for the kinds of pass it has, each named 'TIER SHAPE PRODUCTS' (e.g. 'avx512 tiled bf16-dot').
        """

    def __repr__(self) -> str: ...

class BoundPlan:
    """
    A Plan bound to one layer's K/V (Plan.bind(k, v)): run(q) attends them, converting only
    q and the results. It keeps the plan and the K/V arrays alive.
    """

    def run(self, q: Array, *, out: Array | None = None, lse: Array | None = None) -> tuple[Any, Any]:
        """As Plan.run, on the bound K/V."""

    @property
    def plan(self) -> Plan:
        """The Plan it runs."""

    def __repr__(self) -> str: ...

class SplitLayout:
    """
    The split baseline: every sequence's keys copied into a buffer of its own (shared segments
    once per sequence), attended sequence by sequence. SplitLayout(plan, k, v) copies k, v
    (as Plan.run takes them); run(q) attends.
    """

    def __init__(self, plan: Plan, k: Array | Q8_0 | Sequence[Array | Q8_0], v: Array | Q8_0 | Sequence[Array | Q8_0], *, starts: Sequence[int] | None = None) -> None: ...

    def run(self, q: Array, *, out: Array | None = None, lse: Array | None = None) -> tuple[Any, Any]:
        """As Plan.run, on the copied K/V."""

    @property
    def kv_bytes(self) -> int: ...

class UnifiedLayout:
    """
    The unified baseline: every segment stored once in one buffer, every query row scoring
    every key under a sequence mask. UnifiedLayout(plan, k, v) copies k, v (one dtype);
    run(q) attends.
    """

    def __init__(self, plan: Plan, k: Array | Q8_0 | Sequence[Array | Q8_0], v: Array | Q8_0 | Sequence[Array | Q8_0], *, starts: Sequence[int] | None = None) -> None: ...

    def run(self, q: Array, *, out: Array | None = None, lse: Array | None = None) -> tuple[Any, Any]:
        """As Plan.run, on the copied K/V."""

    @property
    def kv_bytes(self) -> int: ...

__version__: str
