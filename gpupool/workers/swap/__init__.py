"""Models taking turns on a GPU through vLLM's sleep mode.

client.py      vLLM's dev-mode calls: /sleep, /wake_up (+ reload_weights for level 2),
               /is_sleeping; the only code that sends them
demand.py      the requests waiting per model (fed by the pipeline's ``Slots``)
policy.py      which model's turn it is: pure, from the holder and the demand
group.py       one swap group: start-up in turn, switches, idle sleep, failed wakes
controller.py  every group of the configuration, the supervisor's launch gates, admin calls
"""
