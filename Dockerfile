# Image for the Kubernetes package in k8s/ (and any container runtime):
# the five HW4 scripts in /workspace, PyTorch, mpi4py built against Debian's
# Open MPI (mpirun for the MPIJob launcher), and sshd for the MPIJob workers.
#
#   docker build -t <registry>/ie534-hw4:latest .
#   docker push <registry>/ie534-hw4:latest        # then set IMAGE in the overlay
#
# Build arguments:
#   USER_ID, GROUP_ID  the uid/gid of the image's user "mpiuser" (default 1000).
#                      MPIJob pods must run as this user (ssh needs a passwd entry),
#                      so build with --build-arg USER_ID=$(id -u) --build-arg
#                      GROUP_ID=$(id -g) when your cluster identity differs.
#   TORCH_INDEX_URL    empty: torch from PyPI (CUDA-enabled, also runs on CPU);
#                      set it to PyTorch's CPU-only wheel index for a much smaller
#                      CPU-only image.
FROM python:3.11-slim

ARG USER_ID=1000
ARG GROUP_ID=1000
ARG TORCH_INDEX_URL=

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# Open MPI (mpirun + headers: mpi4py is compiled against it), ssh for mpirun and
# the MPIJob workers' sshd, gcc for the mpi4py build.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        openmpi-bin libopenmpi-dev openssh-client openssh-server gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

COPY requirements.txt /tmp/requirements.txt
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" torch torchvision; \
    fi \
 && pip install --no-binary=mpi4py -r /tmp/requirements.txt \
 && python -c "import mpi4py.MPI as m, torch, torchvision; print(m.Get_library_version().splitlines()[0], torch.__version__)"

# The (non-root) user, its sshd config and the ssh client config for mpirun.
RUN groupadd -o -g "$GROUP_ID" mpiuser \
 && useradd -o -m -u "$USER_ID" -g "$GROUP_ID" -s /bin/bash mpiuser \
 && mkdir -p /run/sshd
COPY --chown=mpiuser:mpiuser k8s/image/sshd_config /home/mpiuser/.sshd_config
COPY k8s/image/ssh_config /etc/ssh/ssh_config.d/mpi.conf

WORKDIR /workspace
COPY . /workspace
RUN chmod -R a+rX /workspace

USER ${USER_ID}:${GROUP_ID}
CMD ["python", "resnet_cifar100.py", "--help"]
