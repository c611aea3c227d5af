"""Secrets stay out of every stored git diff (and the dashboard's diff artifacts, copies of it): the forms a credential
scanner's keyword rules find (detect-secrets' KeywordDetector classes), and a private key block's whole body, wherever a
hunk cuts it."""
from __future__ import annotations

import git

from db.capture import git_state

# (fake) secrets in the forms issue 60 found stored
ENVRC = "export API_TOKEN=tok3n-V4lue-xyz\n"
YAML = "db:\n  host: x\n  password: hunter22value\n"
INI = "[default]\nregion = eu\naws_secret_access_key = wJalrXUtnFEMIK7MDENGbPxRfiCYzz\n"
BODY = "QWxhZGRpbjpvcGVuIHNlc2FtZQ" * 2
PEM = ["-----BEGIN RSA " + "PRIVATE KEY-----", *(f"MIIEow{i:02d}{BODY}" for i in range(20)),
       "-----END RSA " + "PRIVATE KEY-----"]


def repo_with(root, files: dict[str, str]) -> git.Repo:
  repo = git.Repo.init(root, initial_branch="main")
  for name, body in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(body)
  repo.git.add("-f", *files)
  who = git.Actor("t", "t@example.com")
  repo.index.commit("init", author=who, committer=who)
  return repo


def test_keyword_secrets_of_shell_yaml_and_ini_files_are_left_out(tmp_path) -> None:
  code = "".join(f"line {i}\n" for i in range(20))
  repo_with(root := tmp_path / "repo", {".envrc": "export A=1\n", "deploy.yaml": "db:\n  host: x\n",
                                        "aws.ini": "[default]\nregion = eu\n", "code.py": code})
  (root / ".envrc").write_text("export A=1\n" + ENVRC)
  (root / "deploy.yaml").write_text(YAML)
  (root / "aws.ini").write_text(INI)
  (root / "code.py").write_text(code.replace("line 3\n", "hide_password=False  # kept\n"))
  d = git_state(root)["diff"]
  for secret in ("tok3n-V4lue-xyz", "hunter22value", "wJalrXUtnFEMIK7MDENGbPxRfiCYzz"): assert secret not in d, d
  assert "+hide_password=False  # kept" in d, d  # code that names a password without one stays
  assert sorted(ln.split(" (")[0] for ln in d.splitlines() if ln.startswith("# left out: a hunk")) == [
    "# left out: a hunk of .envrc", "# left out: a hunk of aws.ini", "# left out: a hunk of deploy.yaml"]


def test_a_private_key_body_line_far_from_its_begin_line_is_left_out(tmp_path) -> None:
  """A changed body line 10 lines past BEGIN: the hunk (3 lines of context) shows neither BEGIN nor END; and a block
  added in two hunks of one file."""
  text = "\n".join(["# notes", *(f"note {i}" for i in range(10)), *PEM, *(f"tail {i}" for i in range(10))]) + "\n"
  repo_with(root := tmp_path / "repo", {"notes.txt": text, "other.md": "a\n" * 30})
  (root / "notes.txt").write_text(text.replace(PEM[10], PEM[10][::-1]))
  other = ["a"] * 30
  other[2:2], other[25:25] = PEM[:4], PEM[4:]  # BEGIN in one hunk, the rest of the block in another
  (root / "other.md").write_text("\n".join(other) + "\n")
  d = git_state(root)["diff"]
  for line in PEM[1:-1]: assert line not in d and line[::-1] not in d, d
  assert "# left out: a hunk of notes.txt" in d and d.count("# left out: a hunk of other.md") == 2, d
