
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 --version
M='import sys; r=[l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]; a=0; n=""
for l in open("/proc/self/smaps"):
    p=l.split()
    if "-" in p[0] and not p[0].endswith(":"): n=p[5] if len(p)>5 else "[anon]"
    elif p[0]=="Rss:" and n in ("[anon]","[heap]"): a+=int(p[1])
print(STEP, "rss_kb", r, "anon_kb", a, "modules", len(sys.modules))'
for i in 1 2 3 4 5; do
python3 -c "STEP='bare'
$M"
python3 -c "import pynvml; pynvml.nvmlInit()
STEP='pynvml+nvmlInit'
$M"
python3 -c "import vramwatch.server.main
STEP='server imports, no pynvml'
$M"
python3 -c "import vramwatch.server.main, pynvml; pynvml.nvmlInit()
STEP='server imports+nvmlInit'
$M"
python3 -S -c "STEP='bare -S'
$M"
done
python3 -c "import pynvml, prometheus_client, importlib.metadata as m; print(m.version(\"nvidia-ml-py\"), m.version(\"prometheus-client\"))"
