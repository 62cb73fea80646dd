package sparksteward.shim

import java.nio.charset.StandardCharsets.UTF_8
import java.nio.file.{Files, Paths}

/** Checks the shim's encoders and its answer parser against the golden protocol files.
 *  Usage: ProtocolGoldenTest <golden dir>. Prints "N passed, M failed"; exits 1 on any failure. */
object ProtocolGoldenTest {
  def main(args: Array[String]): Unit = {
    val dir = Paths.get(args(0))
    def golden(name: String) = new String(Files.readAllBytes(dir.resolve(s"$name.json")), UTF_8).stripSuffix("\n")
    val encoded = Seq(
      "hello" -> Messages.hello("executor", "1", "worker-1", "127.0.0.1", 0, Some("driver-host:40123"),
        Some("/tmp/work/app-1/1"), "00ff", Map("spark.steward.cluster-id" -> "prod", "spark.app.name" -> "golden \"app\"")),
      "app_start" -> Messages.appStart(1700000000000L, "app-20261122-0001", None, "golden", "4.3.0", "alice"),
      "app_end" -> Messages.appEnd(1700000005000L, Some(0), Some("file:/tmp/ckpt/5f1c")),
      "job_start" -> Messages.jobStart(1700000001000L, 3, Some("grp"), Seq("spark-session-u-thread-t-nightly", "etl"),
        Some("count at <stdin>:1\nline2"), 2, Seq(4, 5)),
      "job_end" -> Messages.jobEnd(1700000002000L, 3, succeeded = false, Some("Job aborted: \u0001 \"boom\"")),
      "executor_added" -> Messages.executorAdded(1700000000500L, "1", "worker-1", 1),
      "executor_removed" -> Messages.executorRemoved(1700000004000L, "1", "Command exited with code 137"),
      "task_start" -> Messages.task("task_start", 1700000001500L, 17L, 4, 0, 2, 0),
      "task_succeeded" -> Messages.task("task_succeeded", 1700000001600L, 17L, 4, 0, 2, 0),
      "task_failed" -> Messages.task("task_failed", 1700000001700L, 18L, 4, 0, 3, 1, Some("java.lang.RuntimeException: x")),
      "shutdown" -> Messages.shutdown(1700000006000L, "plugin shutdown"),
      "log_level" -> Messages.encode("log_level", "level" -> "ERROR"),
      "open_file" -> Messages.encode("open_file", "id" -> 7L,
        "url" -> "steward://app-0123456789abcdef/app-20261122-0001/p-00112233445566778899aabbccddeeff/udf.jar"))
    val checks = encoded.map { case (name, line) =>
      (s"encode $name", line == golden(name), s"\n  got:    $line\n  golden: ${golden(name)}")
    } ++ Seq(
      ("parse ready", AgentAnswer.parse(golden("ready")).contains(Ready("127.0.0.1:40123", 35000L)), ""),
      ("parse fatal", AgentAnswer.parse(golden("fatal")).contains(Fatal("CONFIG_INVALID",
        "spark.steward.blob.retention.interval=-5s: must be a duration >= 0, such as 30min")), ""),
      ("escape control characters (Jackson: upper-case hex), keep the rest raw", Messages.shutdown(0L, "\b\f\r\t\u001f\\ \u00e9\u20ac") ==
        "{\"v\":1,\"type\":\"shutdown\",\"time\":0,\"reason\":\"\\b\\f\\r\\t\\u001F\\\\ \u00e9\u20ac\"}", ""),
      ("reply carries the path", AgentAnswer.mapper.readTree(golden("reply")).path("path").asText().endsWith(
        "/p-00112233445566778899aabbccddeeff") && AgentAnswer.parse(golden("reply")).isEmpty, ""),
      ("metrics lines begin with MetricsPrefix", golden("metrics").startsWith(Messages.MetricsPrefix) &&
        AgentAnswer.parse(golden("metrics")).isEmpty, ""),
      ("ignore other lines", AgentAnswer.parse("not json").isEmpty && AgentAnswer.parse("{\"v\":2,\"type\":\"ready\"}").isEmpty, ""))
    checks.foreach { case (name, ok, detail) => println(s"${if (ok) "ok  " else "FAIL"} $name${if (ok) "" else detail}") }
    val failed = checks.count(!_._2)
    println(s"${checks.size - failed} passed, $failed failed")
    sys.exit(if (failed == 0) 0 else 1)
  }
}
