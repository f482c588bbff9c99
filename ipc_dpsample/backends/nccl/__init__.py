"""The NCCL backend: ``cupy.cuda.nccl`` moves the bytes, small kernels put them in place.

The scale-out engine (DESIGN.md "Choosing a backend"): it runs wherever NCCL does,
across hosts included, one GPU per rank.

Modules
-------
``records``   unique id in CuPy's forms, set-up/init records, the error block
``geometry``  kernel names, vector widths, grids, which bytes go to which peer
``plan``      per-shape plans: prepared kernel launches and NCCL peer steps
``setup``     local preparation, the collective set-up rounds, release
``backend``   :class:`NcclBackend`: the per-call paths

Set-up (collective, every wait bounded by the host group's timeout)
--------------------------------------------------------------------
1. Every rank imports ``cupy.cuda.nccl``, compiles ``kernels/nccl.cu`` (NVRTC; the
   permute template instantiated through ``name_expressions``), ``kernels/argmax.cu``
   and ``kernels/verify.cu``, and allocates every persistent buffer; rank 0 also
   creates the NCCL unique id.
2. One fixed-size record per rank travels over the host group: ok flag, unique id
   (rank 0), GPU UUID, error text. A failure on any rank, or two ranks on one GPU
   (NCCL refuses that: "Duplicate GPU detected"), makes **every** rank raise
   :class:`~ipc_dpsample.errors.BackendUnavailableError` naming the rank and cause,
   before anyone blocks in ``ncclCommInitRank``.
3. ``NcclCommunicator(tp, uid, rank)``; the unique id is converted to what the
   installed CuPy accepts (CuPy 13 takes a tuple of 128 signed chars, CuPy 14
   ``bytes``). A second record round reports every rank's init result.

Per call (no allocation, no host sync, no DLPack or torch op; every kernel through
one prepared ``cuLaunchKernel``)
------------------------------------------------------------------------------------
* ``swap_batch_vocab``: ``nccl_header`` writes this rank's header; ``groupStart``;
  per peer one 16-byte header send/recv and one data send/recv (``ncclUint8``: every
  dtype moves bit-exactly; the rows of one peer's requests are contiguous, so the
  sends read the caller's array directly); ``groupEnd``; then ONE permute kernel
  writes ``out[i, s*Vs:(s+1)*Vs] = staging[s, i, :]`` for this rank's real rows,
  taking its own block straight from the input. The permute moves the widest vector
  (16, 8, 4, 2 or 1 bytes) dividing the row size and every base address.
* ``argmax_batch_vocab``: ``nccl_header``; ``dp_argmax_partials`` (kernels/argmax.cu)
  reduces every real row of the whole ``[pad_bs*N, V/tp]`` shard to a 3-word partial
  (max bits, global index, sumexp bits) in a ``[tp, R*N, 3]`` u32 block laid out so
  that this rank's own block is already its receive slot (``geometry.argmax_slots``);
  one NCCL group moves ``R*N*12`` bytes plus the 16-byte header per peer pair;
  ``dp_argmax_combine`` writes ``token_ids int32[R*N]`` and ``logprobs
  float32[R*N]``; ``nccl_finish`` checks the headers and advances ``seq``.
* gathers: a pack kernel writes ``[header | payload]`` into this rank's slot of a
  ``[tp, W]`` int32 buffer, one in-place ``allGather`` of ``W`` words, an unpack
  kernel writes the persistent outputs. ``W = 4 + max_pad_bs/tp * (2N + 1)`` for
  *both* gathers, independent of ``pad_bs`` and ``bs``.
* ``verify_batch_vocab`` (sampled speculative verify without moving the logits;
  docs/verify_contract.md): the per-request parameters (read on the host; six
  ``[pad_bs]`` arrays, ``verify_plan.pack_params``) are copied to the device;
  ``nccl_header``; ``dp_verify_records`` (kernels/verify.cu) reduces every real row
  of the whole ``[pad_bs*N, V/tp]`` shard to one record of ``record_words(cap)`` u32
  (``cap`` the call's largest top-k: 48 bytes for greedy/temperature batches, up to
  1072 at top-k 128) into a send buffer
  whose block ``o`` holds rank ``o``'s rows; one NCCL group moves ``R*N*
  record_words(cap)*4`` bytes plus the 16-byte header per peer pair; the own block is
  copied into its receive slot; ``dp_verify_combine`` turns the ``tp`` records of each
  of this rank's rows into the sampled token (bit for bit the reference) and runs the
  accept chain; ``nccl_verify_finish`` checks the headers and the combine's argument
  check; then the gathers above run inside the same op: 6 launches (8 with
  logprobs), the parameters' host-to-device copy, the own block's device copy (none
  at tp = 1), one send/recv group and one ``allGather`` (two with logprobs). A batch
  with a real request that has top-p or min-p but no top-k takes ``verify_by_swap``
  (swap, the package's torch sampler, gathers). Not CUDA-graph capturable in this
  version (raises under capture).

Real rows (``bs``)
------------------
* host ``bs``: the swap sends to peer ``p`` only ``real_reqs(R, bs, p) * N`` rows
  (zero-byte steps are left out) and the permute writes only this rank's real rows.
  The gathers move every row (a few KB) and stay correct.
* device ``bs`` (an int32 scalar read when the op runs): every op moves fixed byte
  counts (every row), which are right for the real rows whatever the scalar holds
  and keep the op CUDA-graph capturable: a replay reads the scalar's new value (the
  header kernel and the pack kernel put it into the header; the permute and the
  argmax kernels read it from there and handle the real rows it names).
* argmax and verify move fixed byte counts for a host ``bs`` too (12 bytes a row,
  ``record_words(cap)*4`` bytes a row); their kernels skip phantom rows. Phantom
  rows are undefined in every output.

Mismatch detection
------------------
Every op carries one header per rank, ``protocol.Call.header()``:
``[op | dtype << 8, pad_bs, bs, seq]``, where ``seq`` counts the ops this
communicator completed (kept in device memory and advanced by the kernels, so
graph replays need no host). The kernel that ends the op compares every rank's
header with its own and writes the first difference into a host-mapped error
block; every rank that took part sees a difference, so every rank raises
:class:`~ipc_dpsample.errors.DpSampleError` with
:func:`~ipc_dpsample.protocol.divergence_message` at its next call or
:meth:`NcclBackend.check` (sticky: the communicator must be closed). The outputs of
the mismatched call are undefined.

Caught (equal byte counts, different headers), on every rank: another gather (any
``pad_bs`` or ``bs``), another ``bs`` in a gather, in an argmax or verify (host or
device) or in a swap with a device ``bs`` on every rank, another logits dtype in an
argmax or verify, or in a swap of the same element size (bfloat16 vs float16).

``verify_batch_vocab``'s other arguments: every record carries a digest of the call
(``vocab_limit``, list capacity, ``return_logprobs``, ``N``:
``verify_plan.call_digest``) mixed on the device with its request's parameters, and
the row's candidate; the row owner's combine compares them with its own and
``nccl_verify_finish`` writes ``ERR_PARAMS`` (naming the first rank whose records
differ; a parameter value the record kernel refuses: ``ERR_VALUE``) and flips
``SEQ_DIVERGED`` in this rank's ``seq``, so the headers of the gathers in the same op
differ from every peer's and every rank that took part raises, not only the owner
that saw the difference.

Limits (NCCL's, not fixable without a host sync per call): transfers whose sizes
differ between ranks make NCCL wait forever (NCCL has no timeout of its own), and
are undefined in general: a swap, argmax or verify with another ``pad_bs``, a swap
with another element size, a swap with another *host* ``bs`` (its byte counts follow
``bs``), a swap with a host ``bs`` on one rank and a device ``bs`` on another, a
verify whose largest top-k differs between ranks (its record size follows it), ops
of different kinds on different ranks (swap vs argmax: ``R*N*V/tp*itemsize`` vs
``R*N*12`` bytes per pair; any of them vs a gather: send/recv vs allGather), a dead
peer. Use ``check()`` (``ncclCommGetAsyncError``) from a watchdog, and prefer
the one-sided backend within one host, whose waits are bounded.

One op at a time per communicator (DESIGN.md point 9,
:class:`~ipc_dpsample.backends.common.InFlightGuard`): an op issued on another
stream while the previous op is in flight raises before anything is launched.

Lifetime: :meth:`NcclBackend.close` waits (bounded) for every rank at a host
barrier, then destroys the communicator; if a peer is gone it aborts instead and
warns. Outputs are views of persistent buffers, valid until the next op of the
same kind (``verify_batch_vocab`` returns the gathers' outputs: valid until the next
verify or gather). ``prepare`` does no device work.
"""

from __future__ import annotations

from .backend import NcclBackend
from .geometry import (
    KERNEL_NAMES,
    PermuteLaunch,
    packed_width,
    permute_launch,
    permute_name,
    swap_moves,
    vector_width,
)
from .records import (
    ERROR_BYTES,
    ERROR_WORDS,
    HDR_WORDS,
    NCCL_UNIQUE_ID_BYTES,
    format_error_block,
    normalize_unique_id,
    pack_init_record,
    pack_setup_record,
    parse_init_records,
    parse_setup_records,
    unique_id_for_cupy,
    unique_id_form,
)

__all__ = [
    "ERROR_BYTES",
    "ERROR_WORDS",
    "HDR_WORDS",
    "KERNEL_NAMES",
    "NCCL_UNIQUE_ID_BYTES",
    "NcclBackend",
    "PermuteLaunch",
    "format_error_block",
    "normalize_unique_id",
    "pack_init_record",
    "pack_setup_record",
    "packed_width",
    "parse_init_records",
    "parse_setup_records",
    "permute_launch",
    "permute_name",
    "swap_moves",
    "unique_id_for_cupy",
    "unique_id_form",
    "vector_width",
]
