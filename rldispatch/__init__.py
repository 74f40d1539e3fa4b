"""Composition root: config -> store -> rollout -> reward -> advantage -> dispatch -> engine."""
