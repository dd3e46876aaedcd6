"""RL rollouts: prompts (token ids) + sampling settings → completions, their tokens' log-probabilities
under the sampling policy and why each stopped. `engine.py` is the interface and the choice
(`rollout_engine`), `sampling.py` what an engine takes and gives, `continuous.py` maxlite's engine,
`slots.py` how one sequence's decode cache is written into (and cut out of) the slots' batch cache."""
