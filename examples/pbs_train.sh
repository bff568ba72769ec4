#!/bin/bash
# Palmetto's DDP tutorial job (two nodes, two GPUs each) with ddp-launcher instead of a hand-made head-node
# lookup and port: every node reads $PBS_NODEFILE, the first host is the master, the port comes from the
# job id, and this node's rank is its place in the file. Submit with: qsub examples/pbs_train.sh
#PBS -N ddp-launcher
#PBS -l select=2:ncpus=8:mem=16gb:ngpus=2:gpu_model=v100
#PBS -l walltime=1:00:00
#PBS -j oe

cd "$PBS_O_WORKDIR" || exit 2
# pbsdsh -u starts one task per node (without -u: one per line of the node file, i.e. per core).
# Each task sets up its own environment: pbsdsh starts it without a login shell. --nproc-per-node 2:
# ngpus=2 per chunk (the node may show more GPU devices than the job was given). The launcher is one file
# on the shared file system (make dist; copy dist/ddp-launcher.pyz beside main.py: docs/install.md).
pbsdsh -u -- bash -c "
  source /etc/profile.d/modules.sh
  module load anaconda3/2022.05-gcc/9.5.0 cuda/11.6.2-gcc/9.5.0 cudnn/8.1.0.77-11.2-gcc/9.5.0
  source activate pytorch
  cd '$PBS_O_WORKDIR' && python ddp-launcher.pyz --nproc-per-node 2 main.py --epochs 2
"
