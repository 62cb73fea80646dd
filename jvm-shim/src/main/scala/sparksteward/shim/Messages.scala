package sparksteward.shim

/** Encoders for the shim -> agent messages of protocol version 1 (docs/protocol.md).
 *  Each returns one JSON line without the trailing newline; key order is fixed, as in the goldens. */
object Messages {
  val Version = 1
  /** How every agent -> shim `metrics` line begins (protocol.encode_metrics). */
  val MetricsPrefix = "{\"v\":1,\"type\":\"metrics\","

  /** A JSON value: String, Long/Int, Boolean, null/None, Seq of values, or Map[String, String]. */
  private def value(v: Any, sb: StringBuilder): Unit = v match {
    case null | None => sb.append("null")
    case Some(x) => value(x, sb)
    case s: String => string(s, sb)
    case n: Int => sb.append(n)
    case n: Long => sb.append(n)
    case b: Boolean => sb.append(b)
    case m: Map[_, _] =>
      sb.append('{')
      m.toSeq.map { case (k, x) => (k.toString, x) }.sortBy(_._1).zipWithIndex.foreach { case ((k, x), i) =>
        if (i > 0) sb.append(',')
        string(k, sb); sb.append(':'); value(x, sb)
      }
      sb.append('}')
    case xs: Seq[_] =>
      sb.append('[')
      xs.zipWithIndex.foreach { case (x, i) => if (i > 0) sb.append(','); value(x, sb) }
      sb.append(']')
    case other => string(other.toString, sb)
  }

  private def string(s: String, sb: StringBuilder): Unit = {
    sb.append('"')
    s.foreach {
      case '"' => sb.append("\\\"")
      case '\\' => sb.append("\\\\")
      case '\n' => sb.append("\\n")
      case '\r' => sb.append("\\r")
      case '\t' => sb.append("\\t")
      case '\b' => sb.append("\\b")
      case '\f' => sb.append("\\f")
      case c if c < 0x20 => sb.append(f"\\u${c.toInt}%04x")
      case c => sb.append(c)
    }
    sb.append('"')
  }

  def encode(kind: String, fields: (String, Any)*): String = {
    val sb = new StringBuilder
    sb.append("{\"v\":").append(Version).append(",\"type\":")
    string(kind, sb)
    fields.foreach { case (k, v) => sb.append(','); string(k, sb); sb.append(':'); value(v, sb) }
    sb.append('}').toString
  }

  def hello(role: String, executorId: String, host: String, bindHost: String, port: Int,
            driverEndpoint: Option[String], rendezvousDir: Option[String], secret: String,
            conf: Map[String, String]): String =
    encode("hello", "role" -> role, "executor_id" -> executorId, "host" -> host, "bind_host" -> bindHost,
      "port" -> port, "driver_endpoint" -> driverEndpoint, "rendezvous_dir" -> rendezvousDir,
      "secret" -> secret, "conf" -> conf)

  def appStart(time: Long, appId: String, attemptId: Option[String], appName: String,
               sparkVersion: String, user: String): String =
    encode("app_start", "time" -> time, "app_id" -> appId, "attempt_id" -> attemptId,
      "app_name" -> appName, "spark_version" -> sparkVersion, "user" -> user)

  def appEnd(time: Long, exitCode: Option[Int], checkpointDir: Option[String]): String =
    encode("app_end", "time" -> time, "exit_code" -> exitCode, "checkpoint_dir" -> checkpointDir)

  def jobStart(time: Long, jobId: Int, jobGroup: Option[String], jobTags: Seq[String],
               description: Option[String], numStages: Int, stageIds: Seq[Int]): String =
    encode("job_start", "time" -> time, "job_id" -> jobId, "job_group" -> jobGroup,
      "job_tags" -> jobTags.sorted, "description" -> description, "num_stages" -> numStages,
      "stage_ids" -> stageIds)

  def jobEnd(time: Long, jobId: Int, succeeded: Boolean, reason: Option[String]): String =
    encode("job_end", "time" -> time, "job_id" -> jobId,
      "result" -> (if (succeeded) "succeeded" else "failed"), "reason" -> reason)

  def executorAdded(time: Long, executorId: String, host: String, totalCores: Int): String =
    encode("executor_added", "time" -> time, "executor_id" -> executorId, "host" -> host,
      "total_cores" -> totalCores)

  def executorRemoved(time: Long, executorId: String, reason: String): String =
    encode("executor_removed", "time" -> time, "executor_id" -> executorId, "reason" -> reason)

  /** task_start, task_succeeded or task_failed (the latter with a reason). */
  def task(kind: String, time: Long, taskAttemptId: Long, stageId: Int, stageAttemptId: Int,
           partitionId: Int, attemptNumber: Int, reason: Option[String] = None): String = {
    val base = Seq[(String, Any)]("time" -> time, "task_attempt_id" -> taskAttemptId,
      "stage_id" -> stageId, "stage_attempt_id" -> stageAttemptId, "partition_id" -> partitionId,
      "attempt_number" -> attemptNumber)
    encode(kind, (if (kind == "task_failed") base :+ ("reason" -> reason.getOrElse("")) else base): _*)
  }

  def shutdown(time: Long, reason: String): String =
    encode("shutdown", "time" -> time, "reason" -> reason)
}
