"""The time plan: how long a run takes on this machine. `facts` caches what `measure` measured (in a child
process); `work` and `grpo_work` count a step's work term by term; `probed` extrapolates the recipe's own probed
steps; `estimate` is the arithmetic (work at measured rates, start-up, saves, sessions); `assemble` puts it
together for `gpupoor plan` and `train`."""
