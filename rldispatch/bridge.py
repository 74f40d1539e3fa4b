"""Store-aware engine calls: hand an engine a KVBatchMeta, get the meta back with the outputs written.

The bridge fetches just the fields a method needs, calls the engine on a :class:`backends.base.Share`, and
writes the outputs under the same keys. Only the reporting rank of each DP replica writes, so no output is
written twice.
"""
from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict

from backends.base import Engine, Share
from protocol.batch.nested import to_nested
from protocol.fields import IMAGE_GRID_THW, INFER_INPUT_FIELDS, PIXEL_VALUES, PROMPT_IMAGE_FIELDS, TRAIN_INPUT_FIELDS
from protocol.store.keys import group_of
from protocol.store.meta import KVBatchMeta
from rldispatch.dataplane import ShardedStore

__all__ = ["StoreBridge", "INFER_FIELDS", "train_fields", "prompt_images"]

INFER_FIELDS = INFER_INPUT_FIELDS


def train_fields(use_kl_loss: bool, use_is_weights: bool = False) -> tuple[str, ...]:
    """The fields ``train_batch`` reads: the reference log-probs only when the KL loss is on, the rollout
    correction's importance weights only when ``algorithm.rollout_correction.rollout_is`` is set."""
    return TRAIN_INPUT_FIELDS + (("ref_log_prob",) if use_kl_loss else ()) \
        + (("rollout_is_weights",) if use_is_weights else ())


def prompt_images(store: ShardedStore, meta: KVBatchMeta) -> dict[str, torch.Tensor]:
    """Each sample's images, read from its prompt key (a group's images are stored once there): the share fields
    ``PIXEL_VALUES`` / ``IMAGE_GRID_THW`` (jagged; empty for a sample whose tag has no ``vision_spans``, padding
    samples included). A collective: every rank calls it, each with its own ``meta``."""
    owners = [group_of(k) if t.get("vision_spans") else None for k, t in zip(meta.keys, meta.tags)]
    uids = sorted({u for u in owners if u is not None})
    got = store.fetch(uids, meta.partition_id, PROMPT_IMAGE_FIELDS)
    rows = {name: dict(zip(uids, got.get(name).unbind(0))) if uids else {} for name in PROMPT_IMAGE_FIELDS}
    empty = {PIXEL_VALUES: torch.zeros(0, dtype=torch.float32), IMAGE_GRID_THW: torch.zeros(0, dtype=torch.int64)}
    return {name: to_nested([rows[name][u] if u is not None else empty[name] for u in owners])
            for name in PROMPT_IMAGE_FIELDS}


class StoreBridge:
    """Binds one engine to the data plane. Every rank calls each method (the fetch is a collective).

    ``images``: the engine is a vision-language policy; every fetch adds each sample's images
    (:func:`prompt_images`)."""

    def __init__(self, engine: Engine, store: ShardedStore, images: bool = False):
        self.engine = engine
        self.store = store
        self.images = images

    def fetch_infer_inputs(self, meta: KVBatchMeta, wants: Sequence[Sequence[str]] | None = None) -> TensorDict:
        """The fields ``infer_batch`` reads, fetched once so several engines can score the same share.

        ``wants``: every rank's keys (index = store rank) when the plan tells them; no request then travels."""
        return self._fetch(meta, INFER_FIELDS, wants)

    def _fetch(self, meta: KVBatchMeta, fields: Sequence[str], wants: Sequence[Sequence[str]] | None) -> TensorDict:
        if wants is None:
            data = self.store.fetch(meta.keys, meta.partition_id, fields)
        elif list(wants[self.store.rank]) != meta.keys:
            raise ValueError(f"planned fetch: this rank's {len(meta)} keys are not its entry of wants "
                             f"({len(wants[self.store.rank])} keys)")
        else:
            data = self.store.fetch_planned(wants, meta.partition_id, fields)
        if self.images:
            for name, value in prompt_images(self.store, meta).items():
                data.set(name, value)
        return data

    def infer(self, meta: KVBatchMeta, micro_batches: Sequence[Sequence[int]], *, outputs: dict[str, str],
              temperature: float = 1.0, with_entropy: bool = False, data: TensorDict | None = None) -> KVBatchMeta:
        """Run ``infer_batch`` on this rank's ``meta``; write engine field ``k`` as store field ``outputs[k]``.

        ``data`` = :meth:`fetch_infer_inputs` of the same meta, when the caller already holds it (no second fetch).
        """
        if data is None:
            data = self.fetch_infer_inputs(meta)
        result = None
        if len(meta):
            result = self.engine.infer_batch(Share(data, [list(mb) for mb in micro_batches]),
                                             temperature=temperature, with_entropy=with_entropy)
        if result is not None and self.engine.is_reporting_rank and len(meta):
            out = {outputs[k]: result.get(k) for k in outputs if k in result.keys()}
            self.store.kv_batch_put(meta.keys, meta.partition_id, TensorDict(out, batch_size=[len(meta)]))
        return meta

    def train(self, meta: KVBatchMeta, micro_batches: Sequence[Sequence[int]], *, use_kl_loss: bool = False,
              wants: Sequence[Sequence[str]] | None = None, fields: Sequence[str] | None = None,
              use_is_weights: bool = False) -> dict:
        """One optimizer step on this rank's mini-batch share; returns the engine's metrics (``wants``: as
        :meth:`fetch_infer_inputs`; ``fields``: what the engine reads, default the actor's :func:`train_fields`)."""
        data = self._fetch(meta, train_fields(use_kl_loss, use_is_weights) if fields is None else fields, wants)
        # padding samples are known by their tag; the engine counts them zero in every normaliser
        data.set("is_padding", torch.tensor([bool(t.get("is_padding", False)) for t in meta.tags], dtype=torch.bool))
        return self.engine.train_batch(Share(data, [list(mb) for mb in micro_batches]))
