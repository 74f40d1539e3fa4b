"""The RL algorithms as pure functions: reward, KL, advantage, token log-probs and policy losses."""
