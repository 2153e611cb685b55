"""Deltas: a model's deltas as the versions of its delta model, and the plan of each reader.

Theory of operation
-------------------
What it owns: the **delta model** of a model ``m`` (named ``m@delta``,
:func:`tensorhub.core.naming.delta_model`) and the **per-reader plan** of an ``update`` that
can apply deltas.

- **A delta is a shard of a version.** Version ``v`` of ``m@delta``, shard ``i``, is one blob:
  the delta that takes shard ``i`` of ``m`` from ``base`` (the version its publisher published
  before ``v``) to ``v``, in a delta file's bytes (:mod:`tensorhub.runtime.deltafiles`). The
  delta model is an ordinary model of the table in everything else: its holders, grants,
  checksums (of the blob), progress, pipelining (a reader pulling a delta serves it to the next
  one, in its datacenter first), failures and re-grants are those of any shard. Only two
  things differ. Its publish names the ``base`` (:class:`~tensorhub.core.messages.Publish`),
  recorded per (version, shard) and the same for every holder; and its **layout is per
  version**, not per model (each delta's blob has its own size): the first publisher of a
  (version, shard) fixes it, a holder of another layout gets ``LayoutMismatch``, and a reader
  registers the blob's layout before it replicates that version (its size is in the plan).
- **The plan.** An ``update`` whose shards can apply deltas (``Update.deltas``) is decided as
  any update; where it would move to ``v``, the table plans each shard of the replica with
  :func:`tensorhub.core.deltas.plan_pull`: the version the shard holds completely, ``v``, the
  deltas of that shard that a whole (complete or offload) holder of the delta model holds, and
  the shard's full size. Where every shard's plan is a chain of deltas, the same chain of
  versions for all (a model-parallel replica moves together), and ``v``'s checksums are known
  for every shard, the replica gets the chain instead of a pull: the call does not move and
  answers each shard with its :class:`~tensorhub.core.messages.DeltaRef` list (versions, bases,
  blob sizes) and the target. Otherwise it moves as usual (a full pull). Across datacenters the
  first replica of a datacenter to plan a chain pulls the deltas across, and the next ones pull
  them from it (the ordinary source policy prefers a holder nearby); a replica there that must
  pull ``v`` in full (it holds nothing) is told "not yet" while a delta to ``v`` is held or pulled
  in its datacenter (smart skipping, as behind a seeder), then pulls ``v`` from the replica that
  landed it, inside the datacenter.
- **Waiting for a delta.** A trainer's shard that will publish the delta ``b -> v`` says so with
  ``v``'s publish (``Publish.delta_from``). A replica whose every shard holds ``b`` and whose
  update would pull ``v`` in full before that delta exists is told "not yet" (``skipped``),
  for at most ``heartbeat_timeout`` after the publish; then it pulls in full. Without this,
  rollouts that poll right after a publish would each pull the version in full.
- **Smart skipping of deltas.** Where a replica of the reader's datacenter is pulling a delta of
  the planned chain across (a partial holder there, no whole one), the reader is told "not
  yet" too, as behind a seeder of a full version: the next update pulls the delta from it.
- **Landing.** The replica pulls the chain as replicates of the delta model, applies it in place
  and verifies it, then makes ``Replicate(v, held=checksums)``: where ``held`` equals ``v``'s
  declared checksums for the shard, the shard holds ``v`` at once (no bytes move); otherwise it
  pulls ``v`` in full, as a replicate does. A delta applied to the wrong base can therefore never
  be presented as ``v``: its checksums are not ``v``'s.

Invariants: a (version, shard) of a delta model has one base and one layout; a plan is made
only from deltas that a whole holder holds at the moment of the decision, and only for a
replica whose every shard holds one version completely.

- **The bucket tier as a source of last resort.** A shard whose writer stored its copy of a
  version in the bucket tier says so (:class:`~tensorhub.core.messages.BucketStored`); the
  table remembers it for the newest :data:`BUCKET_VERSIONS` versions. When no live holder can
  serve a reader (every source failed it, or none is left), the call fails with
  :class:`~tensorhub.core.errors.InBucket` naming the bucket rather than a plain error: the
  handle restores the version from it, verified, and lands it with ``Replicate(held=...)``.
  So does a ``replicate`` of a version that no holder is left of (the last one closed) when the
  bucket holds every shard of it: the table keeps each bucket copy's checksums with it, to take
  the restore's claim without any holder. A bucket is never chosen while a peer can serve.

What it must never do: plan a chain that differs between the shards of a replica, or take a
``held`` claim for a version whose checksums are unknown.
"""

from __future__ import annotations

from collections.abc import Hashable

from .. import messages as m
from ..deltas import DELTAS, DeltaStep, plan_pull
from ..errors import InBucket, InvalidArgument, LayoutMismatch, TensorHubError, VersionConflict
from ..naming import DELTA_SUFFIX, MAX_NAME_LEN
from .records import C, _Holder, _Model, _Session, _Txn
from .state import TableState


#: models whose bucket copies the table remembers once their records are gone (the newest)
BUCKET_MODELS = 1024
#: versions whose bucket copies the table remembers per model (the newest)
BUCKET_VERSIONS = 64


class DeltaMixin(TableState):
    """Delta models and the per-reader plan. Mixed into :class:`~tensorhub.core.table.ReferenceTable`.
    State (:class:`~tensorhub.core.table.state.TableState`): ``clock``, ``config``, ``models``,
    ``bucket_memory``, ``stats``."""

    def _check_delta_publish(self, s: _Session, version: int, base: int | None) -> None:
        """A delta model's publish names its base (and its blob's layout is the version's);
        any other model's names none.

        Raises:
            InvalidArgument, VersionConflict, LayoutMismatch: nothing changes.
        """
        model = s.model
        ctx = s.ctx(version)
        if model.delta_of is None:
            if base is not None:
                raise InvalidArgument(f"only a delta model ({model.name}{DELTA_SUFFIX}) publishes a base", **ctx)
            return
        if base is None:
            raise InvalidArgument("a delta model's publish names the version its delta applies to (base)", **ctx)
        ver = model.versions.get(version)
        if ver is None:
            return
        known = ver.bases.get(s.shard_idx)
        if known is not None and known != base:
            raise VersionConflict(f"this delta was published with base {known}; this holder says {base}", **ctx)
        layout = ver.layouts.get(s.shard_idx)
        if layout is not None and layout != s.layout:
            raise LayoutMismatch(
                f"this delta's blob has {layout.total_bytes} bytes; this holder's {s.layout.total_bytes if s.layout else 0}",
                **ctx,
            )

    def _record_delta(self, s: _Session, version: int, base: int | None, delta_from: int | None) -> None:
        ver = s.model.versions[version]
        if delta_from is not None and s.model.delta_of is None:
            ver.delta_pending[s.shard_idx] = (delta_from, self.clock() + self.config.heartbeat_timeout)
        if s.model.delta_of is None or base is None or s.layout is None:
            return
        ver.bases.setdefault(s.shard_idx, base)
        ver.layouts.setdefault(s.shard_idx, s.layout)

    def _check_delta_layout(self, s: _Session, version: int) -> None:
        """A reader of a delta model registered the layout of the version it pulls.

        Raises:
            LayoutMismatch: naming both sizes.
        """
        if s.model.delta_of is None:
            return
        ver = s.model.versions.get(version)
        layout = ver.layouts.get(s.shard_idx) if ver is not None else None
        if layout is not None and layout != s.layout:
            have = s.layout.total_bytes if s.layout is not None else 0
            raise LayoutMismatch(
                f"delta {version} of this shard is a blob of {layout.total_bytes} bytes; the registered one has {have}: "
                f"register the delta's layout before pulling it", **s.ctx(version)
            )  # fmt: skip

    def _deltas_of(self, model: _Model) -> _Model | None:
        if len(model.name) + len(DELTA_SUFFIX) > MAX_NAME_LEN:
            return None
        return self.models.get(model.name + DELTA_SUFFIX)

    def _plan_deltas(self, txn: _Txn, v: int) -> bool:
        """Plan the replica of ``txn`` (an update moving to ``v``) a chain of deltas
        (``txn.delta_plan``), if every shard's plan is the same chain; True if it did."""
        model = txn.replica.model
        dm = self._deltas_of(model)
        if dm is None:
            return False
        target = model.versions.get(v)
        if target is None:
            return False
        chain: tuple[int, ...] | None = None
        refs: dict[int, tuple[m.DeltaRef, ...]] = {}
        for idx in range(model.num_shards):
            s = txn.replica.shards.get(idx)
            h = s.holder if s is not None else None
            if s is None or s.layout is None or h is None or h.state is not C or idx not in target.checksums:
                return False
            steps = [
                DeltaStep(ver.bases[idx], d, ver.layouts[idx].total_bytes)
                for d, ver in dm.versions.items()
                if ver.serving[idx] > 0 and idx in ver.bases and idx in ver.layouts and ver.bases[idx] < d
            ]
            plan = plan_pull(h.version, v, steps, s.layout.total_bytes)
            if plan.kind != DELTAS:
                return False
            versions = tuple(step.version for step in plan.steps)
            if chain is None:
                chain = versions
            elif versions != chain:
                return False
            refs[idx] = tuple(m.DeltaRef(st.version, st.base, st.nbytes) for st in plan.steps)
        if chain is None:
            return False
        txn.delta_plan = (v, refs)
        return True

    def _delta_coming(self, txn: _Txn, v: int) -> bool:
        """Every shard of the replica holds the version whose delta to ``v`` its publisher
        announced (``Publish.delta_from``) and is still computing: ask again shortly rather than
        pull in full (bounded by ``heartbeat_timeout`` from the publish)."""
        ver = txn.replica.model.versions.get(v)
        if ver is None or not ver.delta_pending:
            return False
        now = self.clock()
        for idx in range(txn.replica.num_shards):
            s = txn.replica.shards.get(idx)
            h = s.holder if s is not None else None
            pending = ver.delta_pending.get(idx)
            if h is None or h.state is not C or pending is None or pending[0] != h.version or pending[1] <= now:
                return False
        return True

    def _delta_seeding_allows(self, txn: _Txn, s: _Session) -> bool:
        """Smart skipping for a planned chain (DESIGN §5.6, as :meth:`_seeding_allows` for full
        pulls). Where every delta of the chain has a whole holder in the reader's datacenter, it
        pulls them there. Otherwise the first replica of the datacenter planned the chain is its
        **delta seeder** (reserved at once, for ``heartbeat_timeout``, since its pulls show up
        only after a few round trips): it pulls across, and the others are told "not yet" while
        it does (while a delta of the chain has a partial holder there, or the reservation
        holds), rather than queue behind the slow link too."""
        plan = txn.delta_plan
        model = txn.replica.model
        dm = self._deltas_of(model)
        if plan is None or dm is None or not (self.config.pipeline and self.config.smart_skipping):
            return True
        dc = s.location.datacenter
        target = plan[0]
        here, partial = True, False
        for ref in plan[1].get(s.shard_idx, ()):
            ver = dm.versions.get(ref.version)
            for index in ver.index if ver is not None else ():
                w, p = index.in_datacenter(dc)
                here = here and w
                partial = partial or p
        if here:
            model.delta_seeds.pop((target, dc), None)
            return True
        now = self.clock()
        seeder = model.delta_seeds.get((target, dc))
        if seeder is not None and seeder[0] != txn.replica.name and seeder[1] > now and seeder[0] in model.replicas:
            return False
        if partial and seeder is None:
            return False  # a replica of the datacenter pulls a delta of the chain across already
        for key in [k for k in model.delta_seeds if k[1] == dc and k[0] < target]:
            del model.delta_seeds[key]  # older versions' seeds are of no more interest
        model.delta_seeds[(target, dc)] = (txn.replica.name, now + self.config.heartbeat_timeout)
        return True

    def _delta_seeding(self, model: _Model, version: int, dc: str) -> bool:
        """A replica of datacenter ``dc`` holds or pulls a delta to ``version`` (it is landing
        ``version`` there through deltas): a full pull there waits for it, as for a seeder."""
        dm = self._deltas_of(model)
        ver = dm.versions.get(version) if dm is not None else None
        return ver is not None and any(any(index.in_datacenter(dc)) for index in ver.index)

    def _on_bucket_stored(self, peer: Hashable, msg: m.BucketStored) -> None:
        """A shard's writer stored its copy of ``msg.version`` in the bucket tier at ``msg.url``."""
        s = self._session(peer, msg.session)
        model = s.model
        if model.delta_of is not None:
            raise InvalidArgument("a delta model's shards are not stored in a bucket", **s.ctx(msg.version))
        ver = model.versions.get(msg.version)
        sums = ver.checksums.get(s.shard_idx) if ver is not None else None
        model.buckets[(msg.version, s.shard_idx)] = (msg.url, sums)  # the sums: to take a restore's claim later
        if len(model.buckets) > BUCKET_VERSIONS * model.num_shards:  # the oldest go first
            for key in sorted(model.buckets)[: len(model.buckets) - BUCKET_VERSIONS * model.num_shards]:
                del model.buckets[key]
        self.bucket_memory[model.name] = (model.num_shards, model.buckets)  # outlives the model's record
        self.bucket_memory.move_to_end(model.name)
        while len(self.bucket_memory) > BUCKET_MODELS:
            self.bucket_memory.popitem(last=False)
        self._ack(s, msg.req)

    def _in_bucket(self, reader: _Holder, err: TensorHubError) -> TensorHubError:
        """``err`` (no live holder can serve ``reader``), or InBucket naming the bucket tier that
        holds its (version, shard): a source of last resort, never chosen over a peer that can
        serve (this is asked only once none can)."""
        model = reader.session.model
        stored = model.buckets.get((reader.version, reader.shard_idx))
        if stored is None:
            return err
        url = stored[0]
        return InBucket(
            f"{err.message}; the bucket at {url} holds it", bucket=url, **reader.session.ctx(reader.version)
        )

    def _bucket_holds(self, model: _Model, version: int) -> str | None:
        """The bucket URL holding every shard of ``version`` with known checksums, or None: what
        a reader may restore from once no live holder of the version is left."""
        urls = []
        for i in range(model.num_shards):
            stored = model.buckets.get((version, i))
            if stored is None or stored[1] is None:
                return None
            urls.append(stored[0])
        return urls[0] if urls else None

    def _known_checksums(self, model: _Model, version: int, shard: int) -> tuple[int, ...] | None:
        """A (version, shard)'s checksums: declared by a holder, else recorded with its bucket copy."""
        ver = model.versions.get(version)
        known = ver.checksums.get(shard) if ver is not None else None
        if known is None:
            stored = model.buckets.get((version, shard))
            known = stored[1] if stored is not None else None
        return known

    def _holds_already(self, s: _Session, version: int, held: tuple[int, ...] | None) -> bool:
        """``held`` (what the shard's buffers hold, by its own verification) is ``version``'s
        declared checksums for the shard (or those recorded with its bucket copy)."""
        if held is None:
            return False
        known = self._known_checksums(s.model, version, s.shard_idx)
        if known is not None and known == held:
            self.stats["deltas_landed"] += 1
            return True
        self.stats["deltas_refused"] += 1
        return False
