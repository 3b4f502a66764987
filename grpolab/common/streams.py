"""Random-stream ids: the first element of the key of every seeded draw in grpolab.

Each random draw comes from ``numpy.random.default_rng(key)`` with a key that names what is
drawn, so a draw is a pure function of its key: a rollout does not depend on the batch, the
process or the order in which it was made (``grpolab.rollout.sampler.rollout_uniforms``). The id keeps
draws of different kinds apart. Two ids are used twice, 1 and 4; each pair differs in the key's
length (rollout keys have five elements, data draws three or four), so numpy's seed sequences
differ and the draws are independent. They stay as they are so that runs reproduce those of
earlier versions bit for bit.
"""

ROLLOUT = 1  # training rollouts: (ROLLOUT, seed, step, prompt, rollout); the prompt index is global over ranks
TRAIN_DRAW = 1  # the built-in task's training questions: [TRAIN_DRAW, seed, step] (+ [round] after round 0)
DATA_DRAW = 2  # records drawn from a --data file: [DATA_DRAW, seed, step] (+ [round])
EVAL = 3  # held-out evaluation: (EVAL, seed, question) greedy, (EVAL, seed, question, sample) sampled
PROBE = 4  # `grpolab rank`'s rollouts: (PROBE, seed, step, prompt, rollout)
FEW_SHOT = 4  # --few-shot solved examples: [FEW_SHOT, seed, 0]
POOL = 5  # `grpolab mse` / `groupsize` pools: (POOL, seed, prompt, rollout)
DIALOGUE = 6  # `grpolab multiturn`'s episodes: (DIALOGUE, seed, episode)
BRANCH = 7  # continuations branched from a visited state (rtg-mc, grpolab multiturn): (BRANCH, seed, step, turn, episode, branch)
TURN = 10  # a reply after an episode's first: (TURN, *the rollout's key, turn) (grpolab.rollout.episodes.turn_key)
HONEYPOT = 11  # prompts with no correct answer, sampled at each evaluation: (HONEYPOT, seed, step, honeypot, sample)
