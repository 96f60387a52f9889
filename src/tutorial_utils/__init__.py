"""The package behind the book *Training one network on several GPUs with PyTorch*.

- the teaching core, at this level: the network (:mod:`.models`), CIFAR-10 and its loaders
  (:mod:`.data`, :mod:`.loaders`), the one training step (:mod:`.step`), the training entry
  point (:mod:`.train`, configured by :class:`.trainer.TrainConfig`, built from
  :mod:`.trainer`), checkpoints (:mod:`.checkpoint`, :mod:`.sharded_checkpoint`), the step
  graph (:mod:`.step_graph`), memory accounting (:mod:`.memory`), timing (:mod:`.timing`),
  launching (:mod:`.launch`, :mod:`.multinode`), and one parallel strategy per module in
  :mod:`.parallel`, with the programs torchrun starts in :mod:`.workers`;
- the measuring code in :mod:`.bench`: one benchmark per chapter, the step they time, their
  report helpers and their workers;
- the exercises' solutions in :mod:`.solutions`, one module per chapter.

Importing the package imports none of them: a program loads only what it uses.
"""

__version__ = "0.1.0"
