"""The Kubernetes package in k8s/: every overlay renders with `kubectl kustomize`
(the same bytes with every kubectl), the rendered objects are valid, the custom
resources carry what their operators need, and a parameter set in an overlay's
params.yaml lands where it belongs.

kubectl: the `kubectl` on PATH, or the binaries named in $KUBECTL (one path, or
several separated by ':'), e.g. KUBECTL=/usr/bin/kubectl:/opt/k120/usr/bin/kubectl
to check both kustomize v5 and the kustomize v2.0 embedded in kubectl 1.20.
"""
import copy
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import last_value

yaml = pytest.importorskip("yaml", reason="pyyaml is needed (requirements-dev.txt)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is needed (requirements-dev.txt)")

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"

OVERLAYS = {
    # overlay: (workload kind, storage)
    "single-node/user-mounted-nfs": ("Pod", "nfs"),
    "single-node/user-allocated-pvc": ("Pod", "pvc"),
    "multi-node/user-mounted-nfs": ("MPIJob", "nfs"),
    "multi-node/user-allocated-pvc": ("MPIJob", "pvc"),
    "pytorchjob/cpu": ("PyTorchJob", "pvc"),
    "pytorchjob/gpu": ("PyTorchJob", "pvc"),
    "trainjob/torch/user-mounted-nfs": ("TrainJob", "nfs"),
    "trainjob/torch/user-allocated-pvc": ("TrainJob", "pvc"),
    "trainjob/mpi/user-mounted-nfs": ("TrainJob", "nfs"),
    "trainjob/mpi/user-allocated-pvc": ("TrainJob", "pvc"),
}
TRAINJOBS = sorted(o for o, (kind, _) in OVERLAYS.items() if kind == "TrainJob")
# Examples: overlays of an overlay. They set the workload (SCRIPT, ARGS, WORKERS, pod
# size); the storage, image and identity come from the overlay they are built on.
EXAMPLES = {
    # example: (workload kind, storage, the overlay it is built on)
    "examples/resnet50-imagenet-mpijob": ("MPIJob", "nfs", "multi-node/user-mounted-nfs"),
}
RENDERED = {**OVERLAYS, **{name: spec[:2] for name, spec in EXAMPLES.items()}}
COMMON_PARAMS = ["IMAGE", "SCRIPT", "ARGS", "DATASET_DIR", "OUTPUT_DIR"]
STORAGE_PARAMS = {"nfs": ["NFS_SERVER", "NFS_PATH"], "pvc": ["PVC_NAME", "PVC_PATH"]}
ALL_PARAMS = (COMMON_PARAMS + STORAGE_PARAMS["nfs"] + STORAGE_PARAMS["pvc"]
              + ["USER_ID", "GROUP_ID", "FS_ID", "WORKERS"])
# Kubeflow Trainer v2: the label of the replicated job whose container "node" the
# TrainJob's trainer settings go to, and the variables a TrainJob may not set.
TRAINER_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
RESERVED_ENV = {"torch": {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK",
                          "PET_MASTER_ADDR", "PET_MASTER_PORT"},
                "mpi": {"OMPI_MCA_orte_default_hostfile", "OMPI_MCA_plm_rsh_args",
                        "OMPI_MCA_orte_keep_fqdn_hostnames", "OMPI_MCA_orte_set_default_slots"}}
SCRIPTS = ["resnet_cifar100.py", "resnet_tinyimagenet.py", "pretrained_cifar100.py",
           "sync_sgd_cifar100.py", "async_sgd_cifar100.py"]


# --------------------------------------------------------------------------- kubectl
def _kubectl_binaries():
    env = os.environ.get("KUBECTL", "").strip()
    if env:
        return [p for p in env.split(os.pathsep) if p]
    found = shutil.which("kubectl")
    return [found] if found else []


def _kubectl_id(path):
    try:
        out = subprocess.run([path, "version", "--client"], capture_output=True,
                             text=True, timeout=60).stdout
    except OSError:
        return os.path.basename(path)
    m = re.search(r'GitVersion:"(v[\d.]+)|Client Version: (v[\d.]+)', out)
    return "kubectl-" + (m.group(1) or m.group(2)) if m else path


KUBECTLS = _kubectl_binaries()
KUBECTL_PARAMS = ([pytest.param(k, id=_kubectl_id(k)) for k in KUBECTLS] or
                  [pytest.param(None, id="no-kubectl", marks=pytest.mark.skip(
                      reason="no kubectl found: put kubectl on PATH or set KUBECTL "
                             "to its path (Debian: apt-get install kubernetes-client)"))])


@pytest.fixture(params=KUBECTL_PARAMS)
def kubectl(request):
    path = request.param
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"KUBECTL names {path!r}, which is not an executable file")
    return path


def render(kubectl, overlay_dir):
    proc = subprocess.run([kubectl, "kustomize", str(overlay_dir)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (
        f"`{kubectl} kustomize {overlay_dir}` failed:\n{proc.stderr}")
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert docs, f"{overlay_dir} rendered nothing"
    return proc.stdout, docs


def one(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['kind'] for d in docs]}"
    return found[0]


def pod_specs(docs):
    """(role, pod spec) of every pod the workload creates."""
    for d in docs:
        if d["kind"] == "Pod":
            yield "Pod", d["spec"]
        elif d["kind"] == "MPIJob":
            for role, rs in d["spec"]["mpiReplicaSpecs"].items():
                yield role, rs["template"]["spec"]
        elif d["kind"] == "PyTorchJob":
            for role, rs in d["spec"]["pytorchReplicaSpecs"].items():
                yield role, rs["template"]["spec"]
        elif d["kind"] == "TrainJob":
            for role, job_spec in trainjob_jobs(docs):
                yield role, job_spec["template"]["spec"]


def runtime_of(docs):
    """The TrainingRuntime a TrainJob names, from the same rendering."""
    ref = one(docs, "TrainJob")["spec"]["runtimeRef"]
    found = [d for d in docs if d["kind"] == ref.get("kind")
             and d["metadata"]["name"] == ref.get("name")]
    assert len(found) == 1, f"runtimeRef {ref} names no rendered runtime"
    return found[0]


def is_trainer_job(replicated_job):
    labels = replicated_job["template"].get("metadata", {}).get("labels", {})
    return labels.get(TRAINER_LABEL) == "trainer"


def trainjob_jobs(docs):
    """(replicated job name, Job spec) of the Jobs the Kubeflow Trainer makes of a
    TrainJob and its runtime: the runtime's Job templates, with the TrainJob's
    trainer image, command, args and env in the container "node" of the job
    labelled as the trainer, and the securityContext of each runtimePatches entry
    in the pods of the job it names. (What the Trainer adds by itself -- PET_*, the
    MPI hostfile and keys, the Job counts -- is left out.)"""
    job = one(docs, "TrainJob")["spec"]
    trainer = job.get("trainer", {})
    contexts = {}
    for patch in job.get("runtimePatches", []):
        for rj in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            pod_patch = rj.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            contexts.setdefault(rj["name"], {}).update(pod_patch.get("securityContext", {}))
    for rj in runtime_of(docs)["spec"]["template"]["spec"]["replicatedJobs"]:
        job_spec = copy.deepcopy(rj["template"]["spec"])
        pod = job_spec["template"]["spec"]
        if contexts.get(rj["name"]):
            pod["securityContext"] = {**pod.get("securityContext", {}), **contexts[rj["name"]]}
        if is_trainer_job(rj):
            for c in pod["containers"]:
                if c["name"] != "node":
                    continue
                c.update({k: trainer[k] for k in ("image", "command", "args") if k in trainer})
                env = {e["name"]: e for e in c.get("env", []) + trainer.get("env", [])}
                if env:
                    c["env"] = list(env.values())
        yield rj["name"], job_spec


def training_specs(docs):
    """The pod specs whose container runs (or launches) the training script."""
    kind = docs_kind(docs)
    if kind == "TrainJob":
        jobs = runtime_of(docs)["spec"]["template"]["spec"]["replicatedJobs"]
        trainer = [rj["name"] for rj in jobs if is_trainer_job(rj)]
        return [(role, spec) for role, spec in pod_specs(docs) if role in trainer]
    return [(role, spec) for role, spec in pod_specs(docs) if role != "Worker"
            or kind == "PyTorchJob"]


def mounts_storage(kind, role):
    """Whether the pod of `role` mounts the storage: all but the MPI launchers, which
    only run mpirun."""
    return not ((kind == "MPIJob" and role == "Launcher")
                or (kind == "TrainJob" and role == "launcher"))


def docs_kind(docs):
    kinds = {d["kind"] for d in docs} & {"Pod", "MPIJob", "PyTorchJob", "TrainJob"}
    assert len(kinds) == 1, kinds
    return kinds.pop()


def is_operator_resource(doc):
    """A custom resource (Kubeflow's operators), which the Kubernetes schemas do not know."""
    return doc["apiVersion"].split("/")[0] in ("kubeflow.org", "trainer.kubeflow.org")


def command_text(container):
    return "\n".join((container.get("command") or []) + (container.get("args") or []))


def params_of(docs):
    return one(docs, "ConfigMap")["data"]


# --------------------------------------------------------------------------- layout
def test_package_layout():
    for overlay in OVERLAYS:
        d = K8S / overlay
        assert (d / "kustomization.yaml").is_file(), d
        assert (d / "params.yaml").is_file(), d
    found = {str(p.parent.relative_to(K8S)) for p in K8S.rglob("params.yaml")
             if "base" not in p.parts}
    assert found == set(OVERLAYS) | set(EXAMPLES), "overlays on disk and in this test differ"
    readme = (K8S / "README.md").read_text()
    for name in ALL_PARAMS:
        assert name in readme, f"k8s/README.md does not explain {name}"
    for overlay, (_, storage) in OVERLAYS.items():
        text = (K8S / overlay / "params.yaml").read_text()
        for name in (COMMON_PARAMS + STORAGE_PARAMS[storage]
                     + ["USER_ID", "GROUP_ID", "FS_ID", "WORKERS"]):
            if name == "WORKERS" and OVERLAYS[overlay][0] == "Pod":
                continue
            assert name in text, f"{overlay}/params.yaml does not show {name}"


def test_dockerfile_builds_what_the_manifests_expect():
    text = (REPO / "Dockerfile").read_text()
    for needle in ["FROM python:3", "openmpi-bin", "libopenmpi-dev", "openssh-server",
                   "mpi4py", "WORKDIR /workspace", "COPY . /workspace",
                   "k8s/image/sshd_config", "/home/mpiuser/.sshd_config", "USER "]:
        assert needle in text, f"Dockerfile lacks {needle!r}"
    assert (REPO / ".dockerignore").is_file()
    for name in ("sshd_config", "ssh_config"):
        assert "2222" in (K8S / "image" / name).read_text()


# --------------------------------------------------------------------------- rendering
@pytest.mark.parametrize("overlay", sorted(RENDERED))
def test_overlay_renders_valid_objects(kubectl, overlay):
    text, docs = render(kubectl, K8S / overlay)
    kind, storage = RENDERED[overlay]
    for name in ALL_PARAMS:
        assert f"$({name})" not in text, f"$({name}) left unsubstituted"
    assert docs_kind(docs) == kind
    # The oldest and the newest Kubernetes the validator knows.
    versions = sorted({kubernetes_validate.utils.all_versions()[0],
                       kubernetes_validate.utils.latest_version()})
    for version in versions:
        for d in docs:
            if is_operator_resource(d):
                continue
            kubernetes_validate.validate(d, version, strict=True)
        # The pods inside the custom resources are validated as Pods, and the Jobs a
        # TrainJob's runtime makes as Jobs.
        for role, spec in pod_specs(docs):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": role.lower()},
                   "spec": spec}
            kubernetes_validate.validate(pod, version, strict=True)
        if kind == "TrainJob":
            for role, job_spec in trainjob_jobs(docs):
                job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": role},
                       "spec": job_spec}
                kubernetes_validate.validate(job, version, strict=True)
    params = params_of(docs)
    assert set(COMMON_PARAMS + STORAGE_PARAMS[storage]) <= set(params)


@pytest.mark.parametrize("overlay", sorted(RENDERED))
def test_pods_run_as_the_user_and_mount_the_storage(kubectl, overlay):
    _, docs = render(kubectl, K8S / overlay)
    kind, storage = RENDERED[overlay]
    params = params_of(docs)
    identities = set()
    for role, spec in pod_specs(docs):
        sc = spec["securityContext"]
        identities.add((sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]))
        for key in ("runAsUser", "runAsGroup", "fsGroup"):
            assert isinstance(sc[key], int), f"{role}: {key} is not a number"
        if not mounts_storage(kind, role):
            continue                      # mpirun only: no data volumes
        shared = [v for v in spec["volumes"] if v["name"] == "shared"]
        assert len(shared) == 1, f"{role}: no volume 'shared'"
        if storage == "nfs":
            assert shared[0]["nfs"] == {"server": params["NFS_SERVER"],
                                        "path": params["NFS_PATH"]}
        else:
            assert shared[0]["persistentVolumeClaim"]["claimName"] == params["PVC_NAME"]
        mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
        data = mounts[params["DATASET_DIR"]]
        out = mounts[params["OUTPUT_DIR"]]
        assert data["name"] == out["name"] == "shared"
        assert data.get("readOnly") is True, f"{role}: the data must be read-only"
        assert not out.get("readOnly"), f"{role}: the output must be writable"
        prefix = "" if storage == "nfs" else params["PVC_PATH"] + "/"
        assert data["subPath"] == prefix + "data"
        assert out["subPath"] == prefix + "output"
    assert len(identities) == 1, f"pods of one job run as different users: {identities}"


@pytest.mark.parametrize("overlay", sorted(RENDERED))
def test_restarts_resume_from_a_fixed_out(kubectl, overlay):
    _, docs = render(kubectl, K8S / overlay)
    for d in docs:
        if d["kind"] == "Pod":
            assert d["spec"]["restartPolicy"] == "OnFailure"
        elif d["kind"] == "MPIJob":
            specs = d["spec"]["mpiReplicaSpecs"].values()
            assert all(rs["restartPolicy"] == "OnFailure" for rs in specs)
        elif d["kind"] == "PyTorchJob":
            specs = d["spec"]["pytorchReplicaSpecs"].values()
            assert all(rs["restartPolicy"] == "OnFailure" for rs in specs)
        elif d["kind"] == "TrainingRuntime":
            # A failed pod fails its Job at once, and the JobSet restarts all the pods
            # together (torchrun's static rendezvous and mpirun need the whole group).
            js = d["spec"]["template"]["spec"]
            assert js["failurePolicy"]["maxRestarts"] >= 1, "no restart: the run cannot resume"
            for rj in js["replicatedJobs"]:
                assert rj["template"]["spec"]["backoffLimit"] == 0, rj["name"]
                assert rj["template"]["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    for role, spec in training_specs(docs):
        text = command_text(spec["containers"][0])
        assert '--out "$OUTPUT_DIR/$run"' in text, role
        assert "--fresh" not in text, f"{role}: --fresh would defeat the auto-resume"


def test_mpijob_has_what_the_mpi_operator_needs(kubectl):
    for overlay, (kind, _) in RENDERED.items():
        if kind != "MPIJob":
            continue
        _, docs = render(kubectl, K8S / overlay)
        job = one(docs, "MPIJob")
        params = params_of(docs)
        assert job["apiVersion"] == "kubeflow.org/v2beta1"
        spec = job["spec"]
        assert spec["slotsPerWorker"] == 1
        assert spec["sshAuthMountPath"] == "/home/mpiuser/.ssh"
        # The launcher starts once sshd listens in every Worker (mpi-operator >= v0.5).
        assert spec["launcherCreationPolicy"] == "WaitForWorkersReady"
        assert "runPolicy" in spec and "cleanPodPolicy" in spec["runPolicy"]
        rs = spec["mpiReplicaSpecs"]
        assert set(rs) == {"Launcher", "Worker"}
        assert rs["Launcher"]["replicas"] == 1
        assert isinstance(rs["Worker"]["replicas"], int) and rs["Worker"]["replicas"] >= 1
        launcher = rs["Launcher"]["template"]["spec"]["containers"][0]
        text = command_text(launcher)
        assert re.search(r'mpirun -np "\$WORKERS"', text)
        assert "/etc/mpi/hostfile" in text
        assert f"script='{params['SCRIPT']}'" in text and 'python "$script"' in text
        worker = rs["Worker"]["template"]["spec"]["containers"][0]
        assert worker["command"] == ["/usr/sbin/sshd"]
        assert worker["args"][:1] == ["-De"] and "/home/mpiuser/.sshd_config" in worker["args"]
        assert worker["readinessProbe"]["tcpSocket"]["port"] == 2222, (
            "a Worker is Ready (for WaitForWorkersReady) when its sshd listens")
        for c in (launcher, worker):
            assert c["image"] == params["IMAGE"]


def test_pytorchjob_has_what_the_training_operator_needs(kubectl):
    for overlay, (kind, _) in OVERLAYS.items():
        if kind != "PyTorchJob":
            continue
        _, docs = render(kubectl, K8S / overlay)
        job = one(docs, "PyTorchJob")
        params = params_of(docs)
        assert job["apiVersion"] == "kubeflow.org/v1"
        rs = job["spec"]["pytorchReplicaSpecs"]
        assert set(rs) == {"Master", "Worker"}
        assert rs["Master"]["replicas"] == 1
        assert isinstance(rs["Worker"]["replicas"], int) and rs["Worker"]["replicas"] >= 1
        for role in ("Master", "Worker"):
            containers = rs[role]["template"]["spec"]["containers"]
            pytorch = [c for c in containers if c["name"] == "pytorch"]
            assert pytorch, f"{overlay} {role}: no container named 'pytorch'"
            c = pytorch[0]
            assert c["image"] == params["IMAGE"]
            assert f"script='{params['SCRIPT']}'" in command_text(c)
            limits = c.get("resources", {}).get("limits", {})
            if overlay.endswith("gpu"):
                assert limits.get("nvidia.com/gpu") == 1, f"{overlay} {role}: no GPU limit"
            else:
                assert "nvidia.com/gpu" not in limits


def test_trainjob_has_what_kubeflow_trainer_v2_needs(kubectl):
    """The TrainJob overlays against the Trainer v2 API (trainer.kubeflow.org/v1alpha1,
    v2.2 and later): the TrainJob names its runtime, which comes with it; the trainer
    settings reach the container "node" of the job labelled as the trainer; the pods
    that train mount the storage; runtimePatches only name jobs the runtime has."""
    for overlay in TRAINJOBS:
        _, docs = render(kubectl, K8S / overlay)
        params = params_of(docs)
        job = one(docs, "TrainJob")
        assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
        ref = job["spec"]["runtimeRef"]
        assert ref["apiGroup"] == "trainer.kubeflow.org"
        assert ref["kind"] == "TrainingRuntime", "a namespaced runtime, rendered with the job"
        runtime = runtime_of(docs)
        assert runtime["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
        policies = {"torch", "mpi", "jax", "xgboost", "flux"} & set(runtime["spec"]["mlPolicy"])
        framework = overlay.split("/")[1]
        assert policies == {framework}, f"{overlay}: ML policy {policies}"

        trainer = job["spec"]["trainer"]
        assert trainer["image"] == params["IMAGE"]
        assert trainer["command"] and trainer["args"]
        assert isinstance(trainer["numNodes"], int) and trainer["numNodes"] >= 1
        assert trainer["numProcPerNode"] == 1
        reserved = {e["name"] for e in trainer.get("env", [])} & RESERVED_ENV[framework]
        assert not reserved, f"{overlay}: the Trainer refuses a TrainJob setting {reserved}"
        text = command_text(trainer)
        assert f"script='{params['SCRIPT']}'" in text
        assert '--out "$OUTPUT_DIR/$run"' in text and "--fresh" not in text
        launcher = {"torch": "torchrun", "mpi": "mpirun"}[framework]
        assert re.search(rf"^\s*exec {launcher}\b", text, re.M), (
            f"{overlay}: the script is not started by {launcher}")

        jobset = runtime["spec"]["template"]["spec"]
        jobs = {rj["name"]: rj for rj in jobset["replicatedJobs"]}
        trainers = [name for name, rj in jobs.items() if is_trainer_job(rj)]
        assert len(trainers) == 1, f"{overlay}: jobs labelled as the trainer: {trainers}"
        trainer_job = jobs[trainers[0]]
        assert trainer_job.get("replicas", 1) == 1
        containers = trainer_job["template"]["spec"]["template"]["spec"]["containers"]
        assert [c for c in containers if c["name"] == "node"], "the trainer has no container node"
        effective = dict(pod_specs(docs))
        if framework == "torch":
            assert set(jobs) == {"node"} and trainers == ["node"]
        else:
            mpi = runtime["spec"]["mlPolicy"]["mpi"]
            assert set(jobs) == {"node", "launcher"} and trainers == ["launcher"]
            assert mpi["mpiImplementation"] == "OpenMPI"
            assert mpi["sshAuthMountPath"] == "/home/mpiuser/.ssh"
            assert mpi["numProcPerNode"] == 1 and mpi["runLauncherAsNode"] is False
            node = effective["node"]["containers"][0]
            assert node["name"] == "node" and node["image"] == params["IMAGE"]
            assert node["command"] == ["/usr/sbin/sshd"]
            assert "/home/mpiuser/.sshd_config" in node["args"]
            assert node["readinessProbe"]["tcpSocket"]["port"] == 2222
            assert jobs["launcher"]["dependsOn"] == [{"name": "node", "status": "Ready"}]
            assert jobset["successPolicy"]["targetReplicatedJobs"] == ["launcher"], (
                "the job must end with mpirun: sshd never exits")
        # The storage reaches the containers where the training processes run: the
        # node pods (torchrun's, or those mpirun starts the ranks in).
        node = effective["node"]
        mounts = {m["mountPath"]: m["name"] for m in node["containers"][0]["volumeMounts"]}
        assert mounts.get(params["DATASET_DIR"]) == mounts.get(params["OUTPUT_DIR"]) == "shared"
        assert [v for v in node["volumes"] if v["name"] == "shared"]

        # runtimePatches: a "domain/path" manager, jobs the runtime has, and only what
        # trainjob_jobs() applies (the identity).
        for patch in job["spec"]["runtimePatches"]:
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[\w./-]+", patch["manager"])
            for rj in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
                assert rj["name"] in jobs, f"{overlay}: runtimePatches names no job {rj['name']}"
                assert set(rj["template"]["spec"]["template"]["spec"]) == {"securityContext"}
        patched = {rj["name"] for p in job["spec"]["runtimePatches"]
                   for rj in p["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]}
        assert patched == set(jobs), f"{overlay}: jobs without the identity: {set(jobs) - patched}"


def test_readme_applies_the_trainingruntime_before_the_trainjob(kubectl):
    """kustomize puts the TrainJob before its TrainingRuntime, and the Trainer refuses a
    TrainJob whose runtime does not exist yet: the README applies the runtime first with
    a label selector, which must pick exactly the runtime."""
    readme = (K8S / "README.md").read_text()
    m = re.search(r"^kubectl apply -f job\.yaml -l (\S+)=(\S+)\n"
                  r"(?:#.*\n)*kubectl apply -f job\.yaml$", readme, re.M)
    assert m, "k8s/README.md does not apply the runtime, then the job"
    key, value = m.groups()
    for overlay in TRAINJOBS:
        header = (K8S / overlay / "params.yaml").read_text()
        assert f"kubectl apply -f job.yaml -l {key}={value}" in header, overlay
        _, docs = render(kubectl, K8S / overlay)
        selected = [d["kind"] for d in docs
                    if d["metadata"].get("labels", {}).get(key) == value]
        assert selected == ["TrainingRuntime"], f"{overlay}: -l {key}={value} selects {selected}"


@pytest.mark.parametrize("overlay", sorted(RENDERED))
def test_every_kubectl_renders_the_same_bytes(overlay):
    """kustomize v2.0 (kubectl 1.20) and v5 give the same manifests, byte for byte."""
    if len(KUBECTLS) < 2:
        pytest.skip("needs two kubectl binaries in $KUBECTL (e.g. 1.20 and a current one)")
    texts = {k: render(k, K8S / overlay)[0] for k in KUBECTLS}
    first = texts[KUBECTLS[0]]
    for k, text in texts.items():
        assert text == first, f"{k} renders {overlay} differently from {KUBECTLS[0]}"


# --------------------------------------------------------------------------- the commands
FAKE = """#!/bin/sh
# records how it was called
printf '%s\\n' "$(basename "$0")" "$@" > "$FAKE_LOG"
"""


def _run_command(container, tmp_path, env_extra):
    """Run a rendered container command with fake python/mpirun/torchrun; return their argv."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name in ("python", "mpirun", "torchrun"):
        p = bindir / name
        p.write_text(FAKE)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "argv"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "FAKE_LOG": str(log)}
    for e in container.get("env", []):
        env[e["name"]] = e["value"]
    env.update(env_extra)
    cmd = container["command"] + container["args"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines()


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_rendered_command_runs_the_script(kubectl, overlay, tmp_path):
    if not os.path.exists("/bin/sh"):
        pytest.skip("needs /bin/sh")
    _, docs = render(kubectl, K8S / overlay)
    params = params_of(docs)
    kind = docs_kind(docs)
    script = params["SCRIPT"]
    tail = ["--data-dir", params["DATASET_DIR"],
            "--out", params["OUTPUT_DIR"] + "/" + Path(script).stem] + params["ARGS"].split()
    if kind == "MPIJob":
        job = one(docs, "MPIJob")["spec"]["mpiReplicaSpecs"]
        workers = job["Worker"]["replicas"]
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(f"hw4-mpijob-worker-{i}.hw4-mpijob slots=1\n"
                                    for i in range(workers)))
        argv = _run_command(job["Launcher"]["template"]["spec"]["containers"][0], tmp_path,
                            {"OMPI_MCA_orte_default_hostfile": str(hostfile)})
        assert argv[0] == "mpirun"
        assert argv[argv.index("-np") + 1] == str(workers)
        assert argv[argv.index("python") + 1:] == [script] + tail
    elif kind == "TrainJob" and "mpi" in runtime_of(docs)["spec"]["mlPolicy"]:
        # The Trainer writes one hostfile line per node pod, "slots" = numProcPerNode.
        workers = one(docs, "TrainJob")["spec"]["trainer"]["numNodes"]
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(f"hw4-mpi-node-0-{i}.hw4-mpi slots=1\n"
                                    for i in range(workers)))
        (role, spec), = training_specs(docs)
        argv = _run_command(spec["containers"][0], tmp_path,
                            {"OMPI_MCA_orte_default_hostfile": str(hostfile)})
        assert argv[0] == "mpirun"
        assert argv[argv.index("-np") + 1] == str(workers)
        assert argv[argv.index("python") + 1:] == [script] + tail
    elif kind == "TrainJob":
        # torchrun, with the variables the Trainer gives node 1 of 3: torchrun must
        # take the group from them, so nothing on its command line may override them.
        pet = {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
               "PET_MASTER_ADDR": "hw4-torch-node-0-0.hw4-torch", "PET_MASTER_PORT": "29500"}
        (role, spec), = training_specs(docs)
        argv = _run_command(spec["containers"][0], tmp_path, pet)
        assert argv[0] == "torchrun"
        assert argv[argv.index(script):] == [script] + tail
        options = argv[1:argv.index(script)]
        for flag in ("--nnodes", "--nproc-per-node", "--nproc_per_node", "--node-rank",
                     "--node_rank", "--master-addr", "--master_addr", "--master-port",
                     "--master_port", "--standalone", "--rdzv-endpoint", "--rdzv_endpoint"):
            assert not any(o == flag or o.startswith(flag + "=") for o in options), (
                f"torchrun {flag} overrides the Trainer's PET_* variables")
        # A lost rank makes torchrun restart the group (the scripts then resume).
        assert int(last_value(options, "--max-restarts")) >= 1, options
    else:
        for role, spec in training_specs(docs):
            argv = _run_command(spec["containers"][0], tmp_path, {})
            assert argv == ["python", script] + tail, role


# --------------------------------------------------------------------------- parameters
def _set(path, pattern, value, count=1):
    """Edit a parameter the way k8s/README.md says: change its value in params.yaml."""
    text = path.read_text()
    new, n = re.subn(pattern, lambda m: m.group(1) + value, text, flags=re.M)
    assert n == count, f"{path.name}: {pattern!r} matched {n} times, expected {count}"
    path.write_text(new)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_a_parameter_set_once_lands_everywhere(kubectl, overlay, tmp_path):
    kind, storage = OVERLAYS[overlay]
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    params_file = tree / overlay / "params.yaml"
    new = {
        "IMAGE": "registry.example.org/me/ie534-hw4:v7",
        "SCRIPT": "resnet_tinyimagenet.py",
        "ARGS": "--epochs 3 --batch-size 64",
        "DATASET_DIR": "/mnt/in",
        "OUTPUT_DIR": "/mnt/out",
        "NFS_SERVER": "10.1.2.3",
        "NFS_PATH": "/export/alice",
        "PVC_NAME": "alice-rwx",
        "PVC_PATH": "hw4/alice",
    }
    for name in COMMON_PARAMS + STORAGE_PARAMS[storage]:
        _set(params_file, rf"^([ \t]+{name}:[ \t]*).*?(?=[ \t]+#|$)", f'"{new[name]}"')
    _set(params_file, r"^([ \t]+runAsUser:[ \t]*)\d+", "4242")
    _set(params_file, r"^([ \t]+runAsGroup:[ \t]*)\d+", "4343")
    _set(params_file, r"^([ \t]+fsGroup:[ \t]*)\d+", "4444")
    workers = 5
    if kind == "TrainJob":
        _set(params_file, r"^([ \t]+numNodes:[ \t]*)\d+", str(workers))
    elif kind != "Pod":
        replicas = workers if kind == "MPIJob" else workers - 1
        _set(params_file, r"^([ \t]+replicas:[ \t]*)\d+", str(replicas))

    text, docs = render(kubectl, tree / overlay)
    params = params_of(docs)
    for name in COMMON_PARAMS + STORAGE_PARAMS[storage]:
        assert params[name] == new[name]
    for role, spec in pod_specs(docs):
        sc = spec["securityContext"]
        assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (4242, 4343, 4444), role
        for c in spec["containers"]:
            assert c["image"] == new["IMAGE"], role
        if not mounts_storage(kind, role):
            continue
        shared = [v for v in spec["volumes"] if v["name"] == "shared"][0]
        if storage == "nfs":
            assert shared["nfs"] == {"server": new["NFS_SERVER"], "path": new["NFS_PATH"]}
        else:
            assert shared["persistentVolumeClaim"]["claimName"] == new["PVC_NAME"]
        mounts = {m["mountPath"]: m["subPath"]
                  for m in spec["containers"][0]["volumeMounts"] if m["name"] == "shared"}
        prefix = "" if storage == "nfs" else new["PVC_PATH"] + "/"
        assert mounts == {new["DATASET_DIR"]: prefix + "data",
                          new["OUTPUT_DIR"]: prefix + "output"}, role
    for role, spec in training_specs(docs):
        c = spec["containers"][0]
        text = command_text(c)
        assert f"script='{new['SCRIPT']}'" in text, role
        assert new["ARGS"] in text, role
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["DATASET_DIR"] == new["DATASET_DIR"]
        assert env["OUTPUT_DIR"] == new["OUTPUT_DIR"]
    if kind == "MPIJob":
        rs = one(docs, "MPIJob")["spec"]["mpiReplicaSpecs"]
        assert rs["Worker"]["replicas"] == workers
        assert rs["Launcher"]["replicas"] == 1
    elif kind == "PyTorchJob":
        rs = one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]
        assert rs["Master"]["replicas"] + rs["Worker"]["replicas"] == workers
    elif kind == "TrainJob":
        assert one(docs, "TrainJob")["spec"]["trainer"]["numNodes"] == workers
    # The edited overlay still renders valid objects.
    version = kubernetes_validate.utils.latest_version()
    for d in docs:
        if not is_operator_resource(d):
            kubernetes_validate.validate(d, version, strict=True)


def test_scripts_named_in_the_package_exist():
    """Every SCRIPT value in the params files and the README is a script at the root."""
    texts = [(K8S / "README.md").read_text()]
    texts += [p.read_text() for p in K8S.rglob("params.yaml")]
    named = set()
    for text in texts:
        named.update(re.findall(r"\bSCRIPT:[ \t]*['\"]?([\w./-]+\.py)", text))
    assert named, "no SCRIPT values found"
    for script in sorted(named):
        assert script in SCRIPTS, f"SCRIPT: {script} is not one of the HW4 scripts"
        assert (REPO / script).is_file(), f"SCRIPT: {script} does not exist at the repo root"


# --------------------------------------------------------------------------- examples
IMAGENET_EXAMPLE = "examples/resnet50-imagenet-mpijob"


def _parse_with_the_script(script, argv):
    """The script's own argparse namespace for `argv`, as a dict (a subprocess, so that
    torch is imported there and not into this test process)."""
    code = ("import json, sys\n"
            f"sys.path.insert(0, {str(REPO)!r})\n"
            f"import {Path(script).stem} as m\n"
            "print(json.dumps(vars(m.parse_args(sys.argv[1:])), default=str))\n")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{script} rejects {argv}:\n{proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_imagenet_example_runs_resnet50_fp32_over_two_mpi_workers(kubectl, tmp_path):
    """ResNet-50 on an ImageNet-layout folder: v1.5 in FP32 from DATASET_DIR, 2 Workers."""
    if not os.path.exists("/bin/sh"):
        pytest.skip("needs /bin/sh")
    _, docs = render(kubectl, K8S / IMAGENET_EXAMPLE)
    params = params_of(docs)
    rs = one(docs, "MPIJob")["spec"]["mpiReplicaSpecs"]
    assert rs["Worker"]["replicas"] == 2
    assert rs["Launcher"]["replicas"] == 1
    launcher = rs["Launcher"]["template"]["spec"]["containers"][0]
    text = command_text(launcher)
    assert "--dataset imagefolder --arch resnet50" in text
    assert re.search(r"(?<![\w-])--no-amp(?![\w-])", text)
    assert params["SCRIPT"] == "sync_sgd_cifar100.py"
    # The Workers are sized for ImageNet, not the CIFAR defaults of the base.
    worker = rs["Worker"]["template"]["spec"]["containers"][0]
    requests = worker["resources"]["requests"]
    assert int(requests["cpu"]) >= 8 and requests["memory"].endswith("Gi")

    # What mpirun is asked to start, with the launcher's shell expanding ARGS.
    argv = _run_command(launcher, tmp_path,
                        {"OMPI_MCA_orte_default_hostfile": str(_hostfile(tmp_path, 2))})
    assert argv[0] == "mpirun" and argv[argv.index("-np") + 1] == "2"
    py = argv[argv.index("python") + 1:]
    assert py[0] == params["SCRIPT"]
    script_argv = py[1:]
    # ARGS comes after the overlay's own --data-dir/--out, so its values are the ones kept.
    data_dir = last_value(script_argv, "--data-dir")
    assert data_dir.startswith(params["DATASET_DIR"].rstrip("/") + "/"), data_dir
    assert "$" not in data_dir, f"--data-dir {data_dir} was not expanded"
    out = last_value(script_argv, "--out")
    assert out.startswith(params["OUTPUT_DIR"].rstrip("/") + "/") and "$" not in out, out
    assert last_value(script_argv, "--dataset") == "imagefolder"
    assert last_value(script_argv, "--arch") == "resnet50"
    assert "--no-amp" in script_argv and "--amp" not in script_argv
    assert "--fresh" not in script_argv and "--dummy" not in script_argv

    # And the script itself reads them so (the last --data-dir/--out win).
    ns = _parse_with_the_script(params["SCRIPT"], script_argv)
    assert ns["data_dir"] == data_dir == params["DATASET_DIR"].rstrip("/") + "/imagenet"
    assert ns["out"] == out
    assert (ns["dataset"], ns["arch"], ns["amp"]) == ("imagefolder", "resnet50", False)
    assert (ns["epochs"], ns["batch_size"]) == (90, 256)
    assert ns["weight_decay"] == pytest.approx(1e-4)


def test_imagenet_example_takes_storage_and_identity_from_its_overlay(kubectl, tmp_path):
    """The user sets NFS, image and identity once, in the overlay the example is built on;
    the example keeps its own workload and its 2 Workers."""
    kind, storage, built_on = EXAMPLES[IMAGENET_EXAMPLE]
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    example_params = (K8S / IMAGENET_EXAMPLE / "params.yaml").read_text()
    for name in COMMON_PARAMS + STORAGE_PARAMS[storage]:
        if name not in ("SCRIPT", "ARGS"):
            assert not re.search(rf"^[ \t]+{name}:", example_params, re.M), (
                f"{IMAGENET_EXAMPLE}/params.yaml sets {name}: it belongs in {built_on}")
    base_params = tree / built_on / "params.yaml"
    new = {"IMAGE": "registry.example.org/me/ie534-hw4:v7", "DATASET_DIR": "/mnt/in",
           "OUTPUT_DIR": "/mnt/out", "NFS_SERVER": "10.1.2.3", "NFS_PATH": "/export/alice"}
    for name, value in new.items():
        _set(base_params, rf"^([ \t]+{name}:[ \t]*).*?(?=[ \t]+#|$)", f'"{value}"')
    _set(base_params, r"^([ \t]+runAsUser:[ \t]*)\d+", "4242")
    _set(base_params, r"^([ \t]+runAsGroup:[ \t]*)\d+", "4343")
    _set(base_params, r"^([ \t]+fsGroup:[ \t]*)\d+", "4444")
    _set(base_params, r"^([ \t]+replicas:[ \t]*)\d+", "7")

    text, docs = render(kubectl, tree / IMAGENET_EXAMPLE)
    for name in ALL_PARAMS:
        assert f"$({name})" not in text
    params = params_of(docs)
    for name, value in new.items():
        assert params[name] == value, name
    assert params["ARGS"] == one(render(kubectl, K8S / IMAGENET_EXAMPLE)[1],
                                 "ConfigMap")["data"]["ARGS"]
    rs = one(docs, "MPIJob")["spec"]["mpiReplicaSpecs"]
    assert rs["Worker"]["replicas"] == 2, "the example's WORKERS"
    for role, spec in pod_specs(docs):
        sc = spec["securityContext"]
        assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (4242, 4343, 4444), role
        assert spec["containers"][0]["image"] == new["IMAGE"], role
        if role == "Worker":
            shared = [v for v in spec["volumes"] if v["name"] == "shared"][0]
            assert shared["nfs"] == {"server": new["NFS_SERVER"], "path": new["NFS_PATH"]}
            mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
            assert {new["DATASET_DIR"], new["OUTPUT_DIR"]} <= mounts
    # The data path of the run follows DATASET_DIR.
    argv = _run_command(rs["Launcher"]["template"]["spec"]["containers"][0], tmp_path, {
        "OMPI_MCA_orte_default_hostfile": str(_hostfile(tmp_path, 2))})
    assert last_value(argv, "--data-dir") == new["DATASET_DIR"] + "/imagenet"


def _hostfile(tmp_path, workers):
    path = tmp_path / "hostfile"
    path.write_text("".join(f"hw4-mpijob-worker-{i}.hw4-mpijob slots=1\n" for i in range(workers)))
    return path


def test_imagenet_example_on_a_pvc(kubectl, tmp_path):
    """k8s/README.md: pointing the example's `bases:` at user-allocated-pvc runs it on a claim."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    kustomization = tree / IMAGENET_EXAMPLE / "kustomization.yaml"
    _set(kustomization, r"^(- )\.\./\.\./multi-node/user-mounted-nfs[ \t]*$",
         "../../multi-node/user-allocated-pvc")
    _, docs = render(kubectl, tree / IMAGENET_EXAMPLE)
    params = params_of(docs)
    rs = one(docs, "MPIJob")["spec"]["mpiReplicaSpecs"]
    assert rs["Worker"]["replicas"] == 2
    spec = rs["Worker"]["template"]["spec"]
    shared = [v for v in spec["volumes"] if v["name"] == "shared"][0]
    assert shared["persistentVolumeClaim"]["claimName"] == params["PVC_NAME"]
    assert "--arch resnet50" in command_text(rs["Launcher"]["template"]["spec"]["containers"][0])
    assert spec["containers"][0]["resources"]["requests"]["memory"].endswith("Gi")
    version = kubernetes_validate.utils.latest_version()
    for role, pod_spec in pod_specs(docs):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod",
                                      "metadata": {"name": role.lower()}, "spec": pod_spec},
                                     version, strict=True)


def test_readme_documents_the_imagenet_workload():
    readme = (K8S / "README.md").read_text()
    assert "## ResNet-50 on an ImageNet-layout folder" in readme
    assert f"kubectl kustomize k8s/{IMAGENET_EXAMPLE}" in readme
    for needle in ("imagenet/train/<wnid>/", "imagenet/val/<wnid>/", "--no-amp",
                   "--dataset imagefolder", "--arch resnet50", "ILSVRC2012_img_val.tar"):
        assert needle in readme, f"k8s/README.md does not mention {needle}"


@pytest.mark.parametrize("overlay", ["single-node/user-mounted-nfs",
                                     "single-node/user-allocated-pvc"])
def test_imagenet_single_node_variant_from_the_readme(kubectl, overlay, tmp_path):
    """The README's single-node variant: SCRIPT/ARGS and the pod size in params.yaml."""
    readme = (K8S / "README.md").read_text()
    section = readme[readme.index("### Single-node: a Pod"):]
    script = re.search(r"^[ \t]+SCRIPT:[ \t]*(\S+)", section, re.M).group(1)
    args = re.search(r'^[ \t]+ARGS:[ \t]*"([^"]*)"', section, re.M).group(1)
    size = re.search(r"^```\n(  containers:\n.*?)^```", section, re.M | re.S).group(1)
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    params_file = tree / overlay / "params.yaml"
    _set(params_file, r"^([ \t]+SCRIPT:[ \t]*).*?(?=[ \t]+#|$)", script)
    _set(params_file, r"^([ \t]+ARGS:[ \t]*).*?(?=[ \t]+#|$)", f'"{args}"')
    params_file.write_text(params_file.read_text().rstrip("\n") + "\n" + size)

    _, docs = render(kubectl, tree / overlay)
    pod = one(docs, "Pod")
    params = params_of(docs)
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["requests"]["memory"].endswith("Gi")
    assert container["image"] == params["IMAGE"] and container["volumeMounts"]
    argv = _run_command(container, tmp_path, {})
    assert argv[:2] == ["python", script]
    assert last_value(argv, "--data-dir") == params["DATASET_DIR"] + "/imagenet"
    assert last_value(argv, "--out").startswith(params["OUTPUT_DIR"] + "/")
    assert "--no-amp" in argv
    ns = _parse_with_the_script(script, argv[2:])
    assert (ns["dataset"], ns["arch"], ns["amp"]) == ("imagefolder", "resnet50", False)
    assert ns["data_dir"] == params["DATASET_DIR"] + "/imagenet"
    version = kubernetes_validate.utils.latest_version()
    for d in docs:
        kubernetes_validate.validate(d, version, strict=True)
