"""Models taking turns on a GPU through vLLM's sleep mode.

client.py      vLLM's dev-mode calls: /sleep, /wake_up (+ reload_weights for level 2),
               /is_sleeping; the only code that sends them
demand.py      the requests waiting per model (fed by the pipeline's ``Slots``)
policy.py      which model's turn it is: pure, from the holder and the demand
member.py      a group's members and the seams it works through
calls.py       the sleep and wake calls to one member, and what their answers say of it
memory.py      a sleep's memory seen freed: NVML per process, or the GPU's used memory (url:)
verify.py      the checks around a sleep and a wake (memory, the level-2 canary)
group.py       one swap group: start-up in turn, switches, idle sleep, failed wakes
controller.py  every group of the configuration, the supervisor's launch gates, admin calls
"""
