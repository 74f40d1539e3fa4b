"""trainer.mode=separate_async: the split world's transport and the rollout ranks' loop."""
