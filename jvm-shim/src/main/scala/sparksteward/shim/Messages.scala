package sparksteward.shim

/** Encoders for the shim -> agent messages of protocol version 1 (docs/protocol.md).
 *  Each returns one JSON line without the trailing newline; key order is fixed, as in the goldens. */
object Messages {
  val Version = 1
  /** How every agent -> shim `metrics` line begins (shim_protocol.encode_metrics). */
  val MetricsPrefix = "{\"v\":1,\"type\":\"metrics\","

  /** Scala values as the Java values Jackson writes: a Map becomes a sorted map, None null. */
  private def toJava(v: Any): AnyRef = v match {
    case null | None => null
    case Some(x) => toJava(x)
    case m: Map[_, _] =>
      val sorted = new java.util.TreeMap[String, AnyRef]()
      m.foreach { case (k, x) => sorted.put(k.toString, toJava(x)) }
      sorted
    case xs: Seq[_] =>
      val list = new java.util.ArrayList[AnyRef]()
      xs.foreach(x => list.add(toJava(x)))
      list
    case n: Int => Integer.valueOf(n)
    case n: Long => java.lang.Long.valueOf(n)
    case b: Boolean => java.lang.Boolean.valueOf(b)
    case other => other.toString
  }

  /** One message: `v` and `type` first, then `fields` in the order given (Jackson keeps it). */
  def encode(kind: String, fields: (String, Any)*): String = {
    val msg = new java.util.LinkedHashMap[String, AnyRef]()
    msg.put("v", Integer.valueOf(Version))
    msg.put("type", kind)
    fields.foreach { case (k, v) => msg.put(k, toJava(v)) }
    AgentAnswer.mapper.writeValueAsString(msg)
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
           partitionId: Int, attemptNumber: Int, reason: Option[String] = None): String =
    encode(kind, Seq[(String, Any)]("time" -> time, "task_attempt_id" -> taskAttemptId, "stage_id" -> stageId,
      "stage_attempt_id" -> stageAttemptId, "partition_id" -> partitionId, "attempt_number" -> attemptNumber) ++
      (if (kind == "task_failed") Seq("reason" -> reason.getOrElse("")) else Nil): _*)

  def shutdown(time: Long, reason: String): String =
    encode("shutdown", "time" -> time, "reason" -> reason)
}
