"""The batch source: where each RL step's records come from, apart from the step that trains on them.

Owns rank 0's side of a step's batch: made inline (sync mode, ``producer.InlineBatches``) or ahead of the
learner by the producer thread inside a spawned rollout process (async mode, ``producer``, ``rollout_process``,
``rollout_worker``; restarted from the last handed-over step when it dies, ``rollout_restart``); one step's generation, rewards and dynamic sampling (``batch_maker``, ``step_samples``,
``filters``); the records as every rank loads them, checked against the model (``step_records``); and held-out
evaluation on the servers (``evaluate``). It imports the packages below it (records, rollout,
data, reward, tasks), never ``moe_rl.train``: data flows from here to the step.
"""
