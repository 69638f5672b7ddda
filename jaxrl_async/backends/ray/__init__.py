"""The `ray` backend: rollout servers as Ray actors across the nodes of a Ray cluster, the
buffer and the weight store as actors beside the learner."""
