"""The tuner: ``fastddp.hooks.auto()`` picks the hook and bucket size while training
(auto.py, its decision rule in _auto_choice.py); ``--advise`` tells which to pick
(advise.py); both rank the candidates with the cost model (cost_model.py)."""
