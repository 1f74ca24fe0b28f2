"""Command-line tools, kept apart from the library code they call.

Each module is run as ``python -m physicsnemo_foldcp.cli.<tool>`` and holds only argument
parsing, input loading and printing:

* :mod:`~physicsnemo_foldcp.cli.plan_report`: what each rank of a ``cp0 x cp1`` mesh would
  hold of one sample (:func:`physicsnemo_foldcp.sharding.plan_report.plan_report`), and a
  drawing of the partition;
* :mod:`~physicsnemo_foldcp.cli.convert_boltz_weights`: Boltz-2's Lightning ``.ckpt`` read
  without running code from it and written as the project's checkpoint directory
  (:func:`physicsnemo_foldcp.training.boltz_weights.convert_boltz_weights`).
"""
