"""What the stages share: the flow's typed state (context.py, flowtypes.py) and the helpers every stage may use
(records, refunds and counters, target resolution, sizes, denies). Nothing here imports a stage.
"""
