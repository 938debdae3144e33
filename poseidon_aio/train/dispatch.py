"""One step's hooks -> buckets -> syncers: each layer's sync starts the moment backward is done
with it (WFBP), and a merge group's once its last member is in.

Backward hooks run on the backward's thread: they only take what the sync will copy (on the CPU,
a merge group's gradients into its one buffer, while they are warm) and hand the layer to the loop
(:class:`~poseidon_aio.train.handoff.Handoff`: one wake-up per burst of hooks, not one per layer).
The loop wraps the layer's buffers in a :class:`Bucket` and starts its scheme's syncer. This
module is the only place that reads a scheme's traits (:class:`SchemePlan`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import operator
import threading
import time
from typing import Callable, Iterator, Optional

import torch

from ..errors import ConfigError
from ..plan import Mode, Scheme
from ..sync import Bucket, Merging, syncer_class
from .groups import FlatGroups
from .handoff import Handoff
from .layers import FactorCapture, GradReady, Layer, TokenCount
from .staging import Staging
from .step import Aggregates, StepState
from .trace import Span

_INDEX = operator.attrgetter("index")  # a layer's
_READY_AT = operator.itemgetter(1)  # a held (layer, ready_at)'s


class SchemePlan:
    """Every layer's scheme, and what each scheme's syncer needs of the trainer.

    Args:
        layers: the model's layers (:func:`~poseidon_aio.train.layers.discover`).
        schemes: ``{layer index: Scheme}``.
    """

    def __init__(self, layers: list, schemes: dict) -> None:
        self.layers = layers
        self.schemes = schemes
        #: ``{layer name: scheme name}``, as every step reports them.
        self.names = {layer.name: schemes[layer.index].value for layer in layers}

    def captures(self, layer: Layer) -> bool:
        """Whether the layer's scheme sends sufficient factors, not gradients."""
        return syncer_class(self.schemes[layer.index]).captures_factors

    def host_outs(self, layer: Layer) -> bool:
        """Whether the wire writes the layer's results into host memory (not a device kernel)."""
        return syncer_class(self.schemes[layer.index]).host_outs

    def used(self) -> set:
        return set(self.schemes.values())

    def layers_of(self, scheme: Scheme) -> list:
        return [layer for layer in self.layers if self.schemes[layer.index] is scheme]

    def mergeable(self) -> list:
        """The mergeable schemes in use, in a fixed order (every rank the same)."""
        used = self.used()
        return [s for s in Scheme if s in used and syncer_class(s).mergeable]

    def on_ps(self) -> list:
        """The layers the parameter server holds, plain-PS ones first, so any run of them a merge
        plan groups is consecutive in the manifest."""
        layers = [layer for layer in self.layers if syncer_class(self.schemes[layer.index]).on_ps]
        return sorted(layers, key=lambda layer: (self.factored(layer), layer.index))

    def factored(self, layer: Layer) -> bool:
        """Whether the layer's PS messages are factors the shard rebuilds (Project Adam)."""
        return syncer_class(self.schemes[layer.index]).factored


class Dispatch:
    """Starts each layer's sync for the step in flight.

    Args:
        model: the model (the end of its forward is timed: MG-WFBP's backward starts there).
        layers: the model's layers.
        mode: the trainer's :class:`Mode` (``naive`` holds every sync until the backward is over).
        staging: host buffers for a GPU model's tensors.
        aggregates: where results land.
        reduce: the executor that stages a GPU layer's buffers off the loop.
    """

    def __init__(
        self, model: torch.nn.Module, layers: list, mode: Mode, staging: Staging, aggregates: Aggregates, reduce
    ) -> None:
        self.layers = layers
        self.mode = mode
        self.staging = staging
        self.gpu = any(staging.staged(p) for layer in layers for _, p in layer.params)
        self.aggregates = aggregates
        self.flat = FlatGroups(aggregates)
        self.reduce = reduce
        self.plan: Optional[SchemePlan] = None
        self.syncers: dict = {}  # Scheme -> Syncer (a mergeable one wrapped in Merging)
        self.state: Optional[StepState] = None  # the step whose backward runs now
        self._wake_with: dict = {}  # layer index -> its merge group (more than one layer)
        self._held_lock = threading.Lock()  # a GPU backward may run hooks on several threads
        self._loop = asyncio.get_running_loop()
        self._handoff = Handoff(self._loop)  # the hooks' layers, to the loop
        self.ready = {layer.index: GradReady(layer, self._on_ready_threadsafe) for layer in layers}
        self.captures = {
            layer.index: FactorCapture(layer, self._on_ready_threadsafe) for layer in layers if layer.factorable
        }
        self._tokens: list = []  # the planning step's token counts (embeddings)
        self._arming: list = []
        self.accumulating = False  # inside no_sync(): backward passes report nothing
        self._forward_end = model.register_forward_hook(self._forwarded)

    def route(self, plan: SchemePlan, syncers: dict) -> None:
        """Send the layers by ``plan`` through ``syncers``, from the next step."""
        self.plan, self.syncers = plan, syncers
        # What arm() sets each step: (the layer's gradient hooks, its factor capture, whether it sends factors).
        self._arming = [
            (self.ready[layer.index], self.captures.get(layer.index), plan.captures(layer)) for layer in self.layers
        ]
        wake_with = {}
        for syncer in syncers.values():
            if isinstance(syncer, Merging):
                wake_with.update((i, tuple(g)) for g in syncer.groups if len(g) > 1 for i in g)
        self._wake_with = wake_with  # read by the backward's hooks: replaced whole, never edited
        self.flat.clear()  # the old plan's groups' buffers

    def arm(self, state: StepState) -> None:
        """Get the hooks ready for ``state``'s backward: gradients or factors, by scheme.

        Before there is a plan, the step is the planning step: every layer's gradient is made and
        held (an FC layer's factors kept beside it, an embedding's tokens counted), and its rows
        are what the plan is made on, once the backward is over (:meth:`rows`); no second forward."""
        for count in self._tokens:  # (a planning step armed again: after a restore)
            count.remove()
        self._tokens = []
        if self.plan is None:
            state.holding = True
            for layer in self.layers:
                self.ready[layer.index].reset(enabled=True)
                if layer.index in self.captures:
                    self.captures[layer.index].reset(enabled=True, alongside=True)
            self._tokens = [TokenCount(layer) for layer in self.layers if layer.row_sparse]
        else:
            for ready, capture, captures in self._arming:
                ready.reset(enabled=not captures)
                if capture is not None:
                    capture.reset(enabled=captures)
        self.state = state

    @contextlib.contextmanager
    def accumulating_locally(self) -> Iterator[None]:
        """The backward passes run inside add into ``param.grad`` (and an SFB layer's factors
        into its captured rows) and start no sync; the first backward after sends the sum."""
        if self.accumulating:
            raise ConfigError("no_sync() is already on: its contexts do not nest")
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False
            for ready in self.ready.values():
                ready.rearm()

    def rows(self) -> dict:
        """K per layer in the planning step's forward: an FC layer's input rows, an embedding's
        distinct tokens (the rows its gradient can have)."""
        rows = {cap.layer.name: sum(cap.rows) for cap in self.captures.values()}
        for count in self._tokens:
            rows[count.layer.name] = count.rows
            count.remove()
        self._tokens = []
        return rows

    def launch_rest(self, state: StepState) -> None:
        """After the backward: the naive mode's held layers, and layers that gave no gradient."""
        self._handoff.drain()  # hooks' layers not launched yet keep their ready times
        state.compute_done = True
        launched = state.launched
        for layer in [*state.deferred, *reversed(self.layers)]:
            if layer.index not in launched:  # (most are: a call each would cost the loop for nothing)
                self._launch(state, layer)

    def remove(self) -> None:
        for hook in [*self.ready.values(), *self.captures.values(), *self._tokens, self._forward_end]:
            hook.remove()
        self.ready.clear()
        self.captures.clear()
        self._arming = []

    # -- on the backward's thread -----------------------------------------------------------

    def _forwarded(self, module, inputs, output) -> None:
        if self.state is not None:
            self.state.forward_end = time.perf_counter()

    def _on_ready_threadsafe(self, layer: Layer) -> None:
        # A staged layer's copies run later, off the loop: what they copy is taken here, where
        # the backward made it, with the point on its stream where it was made. Read later on
        # another thread, under SSP ``p.grad`` is being replaced by the next step's backward
        # (autograd writes it without the GIL) and the factor captures reset by its forward.
        if self.accumulating:
            return
        state = self.state
        if self.gpu:
            cap = self.captures.get(layer.index)
            if cap is not None and (self.plan is None or self.plan.captures(layer)) and cap.captured:
                u, v = cap.factors()
                state.taken[("factors", layer.index)] = (u, v, self.staging.ready_event(u))
            for i, (_, p) in zip(layer.param_ids, layer.params):
                g = p.grad
                if g is not None:
                    state.taken[i] = (g, self.staging.ready_event(g))
        now = time.perf_counter()
        group = self._wake_with.get(layer.index)
        if group is None:
            self._handoff.call(self._launch, state, layer, now)
            return
        # A merge group's message leaves once its last member is in: wake the loop once for all
        # of them, not once a layer (each wake-up costs the loop a pass and the backward the GIL).
        # A member that never reports is launched with the rest of the layers after the backward.
        with self._held_lock:
            held = state.held.setdefault(group, [])
            held.append((layer, now))
            complete = len(held) == len(group)
        if complete:
            # On the CPU the group's copy into its buffer is made here, where the backward has just
            # made the gradients, not on the loop woken cold; None: the loop makes it.
            layers = [self.layers[i] for i in sorted(layer.index for layer, _ in held)]
            flat = None if self.gpu else self.flat.made(state, layers)
            self._handoff.call(self._launch_held, state, held, layers, flat)

    # -- on the loop ------------------------------------------------------------------------

    def _launch_held(self, state: StepState, held: list, layers: list, flat: Optional[Bucket]) -> None:
        """A merge group whose layers are all in (``layers``: model order): one bucket, one sync,
        one span (a future and a callback per layer would cost the loop more). On CPU the bucket
        is one buffer (:class:`FlatGroups`; ``flat``: filled by the hook already); a GPU's buckets
        are staged off the loop, one layer at a time."""
        scheme = self.plan.schemes[held[0][0].index]
        syncer = self.syncers.get(scheme)
        # (map and attrgetter, not generators: this runs on the loop once a group a step)
        if self.gpu or not isinstance(syncer, Merging) or not state.launched.isdisjoint(map(_INDEX, layers)):
            for layer, ready_at in held:
                self._launch(state, layer, ready_at)
            return
        for layer, ready_at in held:
            state.launched.add(layer.index)
            state.ready_at[layer.index] = ready_at
        span = Span(f"{layers[-1].name}..{layers[0].name}", scheme, max(map(_READY_AT, held)), time.perf_counter())

        def start() -> asyncio.Future:
            bucket = flat if flat is not None else self.flat.bucket(state, layers)
            if bucket is not None:
                return syncer.start_merged(bucket, state.clock)
            return syncer.start_group([self._bucket(state, layer, scheme) for layer in layers], state.clock)

        self._start(state, scheme, span, start, [i for layer in layers for i in layer.param_ids])

    def _launch(self, state: StepState, layer: Layer, ready_at: Optional[float] = None) -> None:
        if layer.index in state.launched:
            return
        if (state.holding or self.mode is Mode.NAIVE) and not state.compute_done:
            # Naive: nothing moves until the backward is over; the planning step: nor until the plan.
            if state.holding:  # (its ready times are the merge planner's first samples)
                state.ready_at.setdefault(layer.index, ready_at or time.perf_counter())
            state.deferred.append(layer)
            return
        state.launched.add(layer.index)
        state.ready_at.setdefault(layer.index, ready_at or time.perf_counter())
        scheme = self.plan.schemes[layer.index]
        span = Span(layer.name, scheme, state.ready_at[layer.index], time.perf_counter())
        if self.gpu:  # the host copies wait on CUDA streams: off the loop
            self._start(
                state,
                scheme,
                span,
                lambda: asyncio.ensure_future(self._staged_sync(state, layer, scheme)),
                layer.param_ids,
            )
        else:  # CPU tensors are their own host buffers: start at once, no task of our own
            self._start(
                state,
                scheme,
                span,
                lambda: self.syncers[scheme].start(self._bucket(state, layer, scheme), state.clock),
                layer.param_ids,
            )

    def _start(
        self, state: StepState, scheme: Scheme, span: Span, start: Callable[[], asyncio.Future], ids: list
    ) -> None:
        """Start one sync of ``state``'s step (``start()``: its syncer's call), traced by ``span``;
        it lands the parameters ``ids`` (manifest indices)."""
        state.spans.append(span)
        try:
            sync = start()
        except Exception as exc:  # noqa: BLE001 - it fails the step, as a failed sync does
            sync = self._loop.create_future()
            sync.set_exception(exc)
        sync.add_done_callback(functools.partial(self._synced, state, scheme.value, span))
        state.syncs.append(sync)
        state.sync_ids.append(ids)

    async def _staged_sync(self, state: StepState, layer: Layer, scheme: Scheme):
        bucket = await self._loop.run_in_executor(self.reduce, self._bucket, state, layer, scheme)
        return await self.syncers[scheme].start(bucket, state.clock)

    @staticmethod
    def _synced(state: StepState, scheme: str, span: Span, sync: asyncio.Future) -> None:
        span.end = time.perf_counter()
        if sync.cancelled() or sync.exception() is not None:
            return  # the step's apply raises it
        result = sync.result()
        state.bytes[scheme] = state.bytes.get(scheme, 0) + result.bytes_sent + result.bytes_received
        state.dropped.update(result.dropped)
        state.work.extend(result.work)

    def _bucket(self, state: StepState, layer: Layer, scheme: Scheme) -> Bucket:
        """The layer's buffers as its scheme moves them: host views on CPU, staged copies on a GPU
        (then this runs off the loop: the copies wait on a CUDA stream)."""
        priority = layer.index  # nearest the input first: it gates the next forward
        if syncer_class(scheme).host_outs:  # the wire writes host memory
            outs = [self.aggregates.landing(state, i) for i in layer.param_ids]
        else:  # a kernel writes the (device) tensors itself
            outs = [state.agg[i] for i in layer.param_ids]
        if syncer_class(scheme).captures_factors:
            cap = self.captures[layer.index]
            m, n = layer.module.weight.shape
            u, v, event = state.taken.pop(("factors", layer.index), None) or (None, None, None)
            if u is None and cap.captured:
                u, v = cap.factors()
            elif u is None:  # unused here: K = 0
                u, v = torch.zeros(0, m), torch.zeros(0, n)
                state.unused.update(layer.param_ids)
            fu, fv = u.float(), v.float()
            if fu is not u or fv is not v:  # the event marks u and v, not a cast made here
                event = None
            u, v = self.staging.host(("u", layer.index), fu, event), self.staging.host(("v", layer.index), fv, event)
            return Bucket(
                layer.name, [layer.index], layer.param_ids, outs, factors=(u, v), shape=(m, n), priority=priority
            )
        grads = []
        for i, (_, p) in zip(layer.param_ids, layer.params):
            g, event = state.taken.pop(i, None) or (p.grad, None)
            if g is None:  # an unused branch: zeros
                g = torch.zeros_like(p)
                state.unused.add(i)
            c = g.contiguous()
            # The event marks g; a copy of it made here is waited for on this thread's stream.
            grads.append(self.staging.host(("grad", i), c, event if c is g else None))
        return Bucket(layer.name, [layer.index], layer.param_ids, outs, grads=grads, priority=priority)
