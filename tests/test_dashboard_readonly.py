"""The dashboard cannot destroy a study: optuna-dashboard's UI and API can delete, rename and annotate studies, and any
page a browser opens could send such a request to a local port. `search dashboard` answers reads alone, only for its own
address and origin, and its storage view refuses every write."""
from __future__ import annotations

import http.client
import re
import subprocess
import sys

import optuna
import pytest

from search.ranked import RankedStorage, ReadOnlyStorage

FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed",
        "0"]


@pytest.fixture(scope="module")
def served(gguf_file, tmp_path_factory):
  """A 2-trial study of fake trials on SQLite, and `search dashboard` serving it on a free port."""
  from inject.trialfakes import env
  d = tmp_path_factory.mktemp("dash")
  url = f"sqlite:///{d / 's.db'}"
  subprocess.run([sys.executable, "-m", "search", "start", "--model", gguf_file("tiny", "q4_0"), "--study", "d",
                  "--storage", url, "--trials", "2", *FAST], env=env(seconds=0.05), check=True, capture_output=True)
  proc = subprocess.Popen([sys.executable, "-m", "search", "dashboard", "--storage", url, "--port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  line = proc.stdout.readline()
  port = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
  assert port, line
  yield url, int(port.group(1))
  proc.terminate()
  proc.wait()


def request(port: int, method: str, path: str, **headers: str) -> tuple[int, str]:
  c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  c.request(method, path, body=b"{}" if method in ("POST", "PUT") else None,
            headers={"Host": f"127.0.0.1:{port}", **headers})
  r = c.getresponse()
  return r.status, r.read().decode(errors="replace")


def test_the_dashboard_refuses_every_write(served) -> None:
  url, port = served
  assert request(port, "GET", "/api/studies")[0] == 200
  for method, path in (("DELETE", "/api/studies/1"), ("PUT", "/api/studies/1/note"), ("POST", "/api/studies"),
                       ("POST", "/api/studies/1/rename"), ("POST", "/api/artifacts/1")):
    status, body = request(port, method, path)
    assert status == 405 and "read-only" in body, (method, path, status, body)
  assert optuna.get_all_study_names(url) == ["d"]
  assert len(optuna.load_study(study_name="d", storage=url).trials) >= 2


def test_the_dashboard_answers_its_own_address_and_origin_alone(served) -> None:
  _, port = served
  assert request(port, "GET", "/api/studies", Host=f"localhost:{port}")[0] == 200
  assert request(port, "GET", "/api/studies", Origin=f"http://127.0.0.1:{port}")[0] == 200
  assert request(port, "GET", "/api/studies", Host=f"rebound.example:{port}")[0] == 403  # DNS rebinding
  assert request(port, "GET", "/api/studies", Host=f"127.0.0.1:{port + 1}")[0] == 403
  assert request(port, "GET", "/api/studies", Origin="http://evil.example")[0] == 403


def test_the_ranked_storage_writes_nothing(served) -> None:
  url, _ = served
  st = RankedStorage(url)
  with pytest.raises(ReadOnlyStorage, match="read-only"): st.delete_study(st.get_study_id_from_name("d"))
  with pytest.raises(ReadOnlyStorage): st.set_study_user_attr(1, "note", "x")
  assert optuna.get_all_study_names(url) == ["d"]
